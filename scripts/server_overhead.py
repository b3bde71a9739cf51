"""What the OpenAI-compatible server costs: time to first token and tokens/s of the same greedy generation through
`usd.stream` in-process (on a thread of its own, as the server runs it) and through /v1 (streamed, the official
`openai` client, 127.0.0.1), alternating, in one run.

    python scripts/server_overhead.py --max-tokens 32 --reps 3 --algorithm slem

Prints both medians and their ratio. Loads the default pair (or --target/--drafter) once; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--algorithm", default="slem")
    ap.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    args = ap.parse_args()

    import uvicorn
    from openai import OpenAI

    import usd
    from usd.serve import FixedPair, create_app

    pair = usd.load_pair(args.target, args.drafter, log=lambda *_: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(FixedPair(pair)), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "user", "content": args.prompt}]
    settings = usd.GenerationSettings(algorithm=args.algorithm, max_new_tokens=args.max_tokens)

    def direct():
        # On a fresh thread, as the server (and the app) run each generation: on this machine, under load, the same
        # generation on the main thread ran 3-10x slower than on a worker thread, with or without a server.
        out = []
        worker = threading.Thread(target=lambda: out.append(direct_here()))
        worker.start()
        worker.join()
        return out[0]

    def direct_here():
        t0 = time.perf_counter()
        first, text = None, ""
        for event in usd.stream(pair, messages=messages, settings=settings):
            if isinstance(event, usd.Round) and first is None and any(p.text for p in event.emitted):
                first = time.perf_counter() - t0
            if isinstance(event, usd.Finished):
                text, tokens = event.text, len(event.target_ids)
        return first, tokens / (time.perf_counter() - t0), text

    def served():
        t0 = time.perf_counter()
        first, text, tokens = None, "", 0
        for chunk in client.chat.completions.create(
            model=pair.target_name,
            messages=messages,
            max_tokens=args.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": {"algorithm": args.algorithm}},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first if first is not None else time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, tokens / (time.perf_counter() - t0), text

    direct()  # warm-up: first forwards, auto's and the renderings' memory
    runs = {"usd.stream": [], "/v1": []}
    for i in range(args.reps):
        order = (("usd.stream", direct), ("/v1", served))
        for name, fn in order if i % 2 == 0 else order[::-1]:  # alternating, and which goes first too
            runs[name].append(fn())
            print(f"  run {i + 1} {name:10} ttft {runs[name][-1][0]:.3f} s  {runs[name][-1][1]:.2f} tokens/s")
    texts = {r[2] for rs in runs.values() for r in rs}
    med = {
        name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for name, rs in runs.items()
    }
    print(
        f"{args.max_tokens} tokens, algorithm {args.algorithm}, greedy, {args.reps} alternating runs each "
        f"(medians); identical text: {len(texts) == 1}"
    )
    for name, (ttft, tps) in med.items():
        print(f"  {name:10} time to first token {ttft:.3f} s   {tps:.2f} tokens/s")
    (d_ttft, d_tps), (s_ttft, s_tps) = med["usd.stream"], med["/v1"]
    print(f"  /v1 vs usd.stream: time to first token x{s_ttft / d_ttft:.3f}, tokens/s x{s_tps / d_tps:.3f}")
    server.should_exit = True


if __name__ == "__main__":
    main()
