"""The edge cases of docs/design.md, section 10, each forced deterministically and each checked for losslessness.

Proven here, for tli and slem (and plain decoding where it applies), greedy in float32 on CPU:
- the drafter proposes end-of-sequence: accepted (generation stops, "eos") or rejected (shown struck out, the target
  goes on); either way the output is plain greedy's;
- the target ends mid-draft (its eos replaces a candidate while more remained): stop "eos", eos not in the text;
- a token splits a multi-byte character (byte-level BPE pieces, Gemma's <0xNN> byte fallback, a round that ends
  inside a character): no emitted piece ever shows a partial character (no U+FFFD) and the pieces add up to the text;
- the prompt and the answer hold tokens outside the shared vocabulary (target-only special tokens, whole CJK words the
  drafter spells in bytes): tli never drafts them, slem can through text, and both equal plain greedy;
- max_new_tokens falls inside a round: exactly that many tokens, the round's pieces truncated;
- k = 0 is plain decoding and never touches the drafter;
- a cancelled stream ends "cancelled" and leaves the models untouched and usable;
- no algorithm modifies the models, under sampling either (weights, embeddings and modules stay as they were).

Every case is built on tiny random Llama models with the real tokenizers whose greedy output is *scripted*: the LM
head rows of a few tokens are solved from the hidden states along a chosen path (`script`), so the target says exactly
the tokens chosen and the drafter drafts exactly the tokens chosen. Each test first asserts that the edge case really
happened (on the Round events or the drafts the loop asked for), then that the output equals plain decoding: the
loop's own "none" path and transformers' `generate`. (tests/test_decoder_greedy.py covers emoji and CJK prompts on
the real pair.)

Each case runs twice: on the real tokenizers (slow tier) and on the stand-ins tests/tiny_tokenizers.py builds in their
shapes (fast tier), except the cases marked real_tokenization, which assert how the real ones split a text.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch
from tiny_pairs import how, tiny_config
from transformers import LlamaForCausalLM

import usd.decoder
import usd.drafters
from usd.decoder import stream
from usd.events import Finished, Round
from usd.pair import Pair, bytes_of
from usd.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a thread pool only slows them down

QWEN, SMOL, GEMMA = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"
SPEC = ("tli", "slem")
EOS_STRING = "<|im_end|>"  # Qwen's and SmolLM2's end of sequence (and end of turn)


# ---------------------------------------------------------------------------------------------------------------------
# scripted tiny models


def tiny_model(tokenizer, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(tokenizer)).eval()
    # like a real checkpoint: generation stops at the tokenizer's eos (the config default would be id 2)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model


@torch.no_grad()
def script(model, context: list[int], output: list[int], margin: float = 100.0) -> None:
    """Make greedy decoding after `context` produce exactly `output`: the hidden states along context + output do not
    depend on the LM head, so solve its rows for the output's tokens (least squares) to put a logit of `margin` on the
    right token at every step and 0 on the other scripted tokens; unscripted rows stay small and random."""
    ids = torch.tensor([list(context) + list(output[:-1])])
    h = model.model(input_ids=ids).last_hidden_state[0, len(context) - 1 :]  # [n, hidden]
    tokens = sorted(set(output))
    y = torch.zeros(len(output), len(tokens))
    for i, t in enumerate(output):
        y[i, tokens.index(t)] = margin
    model.lm_head.weight[tokens] = (torch.linalg.pinv(h) @ y).T


_ALIGNED: dict[tuple[int, int], dict] = {}


def scripted_pair(tt, dt, prompt: str, target_out: list[int], drafter_out: list[int] | None, margin: float = 100.0):
    """(pair, target prompt ids, drafter prompt ids); the target says target_out, the drafter (fed its own drafts from
    the prompt on) drafts drafter_out."""
    target, drafter = tiny_model(tt, 0), tiny_model(dt, 1)
    ids, dids = tt.encode(prompt), dt.encode(prompt)
    script(target, ids, target_out, margin)
    if drafter_out:
        script(drafter, dids, drafter_out, margin)
    # The vocabulary alignment depends on the tokenizers only (and the vocab sizes, equal here) and takes seconds:
    # compute it once per tokenizer pair and hand it to every pair built from the same two tokenizers.
    aligned = _ALIGNED.get((id(tt), id(dt)))
    pair = Pair(target, tt, drafter, dt, _cache=dict(aligned or {}))
    if aligned is None:
        pair.intersection()
        _ALIGNED[(id(tt), id(dt))] = dict(pair._cache)
    return pair, ids, dids


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=["tiny", pytest.param("real", marks=pytest.mark.real_models)])
def tok(request):
    """The tokenizers by family: the real ones (slow tier), or the ones tests/tiny_tokenizers.py builds in the
    shapes of the same three (fast tier: a byte-level target and drafter with ChatML's <|im_end|>, and SentencePiece
    with byte fallback)."""
    if request.param == "real":
        return request.getfixturevalue("real_tokenizers")
    import tiny_tokenizers as tiny

    return {QWEN: tiny.target(), SMOL: tiny.drafter_byte_level(), GEMMA: tiny.drafter_sentencepiece()}


@pytest.fixture(autouse=True)
def _real_tokenization_only(request):
    """A test marked real_tokenization asserts how the real tokenizers split its text: it runs on those only."""
    spec = getattr(request.node, "callspec", None)
    if request.node.get_closest_marker("real_tokenization") and spec and spec.params.get("tok") == "tiny":
        pytest.skip("asserts the real tokenizers' exact tokenization")


@pytest.fixture
def drafts(monkeypatch):
    """The drafts the loop asked for, round by round (the candidates in target ids)."""
    seen: list[list[int]] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            draft = fn(*args, **kwargs)
            seen.append(list(draft.candidates))
            return draft

        return wrapped

    monkeypatch.setattr(usd.drafters, "draft_tokens", spy(usd.drafters.draft_tokens))
    monkeypatch.setattr(usd.drafters, "draft_strings", spy(usd.drafters.draft_strings))
    return seen


def run(pair, ids, dids, **kwargs) -> tuple[list[Round], Finished]:
    loop = {"probe_first": kwargs.pop("probe_first", False)}
    loop.update({key: kwargs.pop(key) for key in ("cancel", "memory") if key in kwargs})
    events = list(stream(pair, ids, dids, how(**kwargs), **loop))
    assert all(isinstance(e, Round) for e in events[:-1]) and isinstance(events[-1], Finished)
    return events[:-1], events[-1]


@torch.no_grad()
def reference(pair: Pair, ids: list[int], max_new: int) -> tuple[list[int], bool]:
    """transformers' plain greedy: (tokens before any eos, whether it ended with eos)."""
    out = pair.target.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
    )[0, len(ids) :].tolist()
    eos = pair.eos_ids()
    for i, t in enumerate(out):
        if t in eos:
            return out[:i], True
    return out, False


def assert_plain(pair, ids, dids, done: Finished, max_new: int) -> None:
    """The output is plain greedy's: the loop's own k = 0 path and transformers' generate."""
    _, plain = run(pair, ids, dids, algorithm="none", max_new_tokens=max_new)
    assert done.target_ids == plain.target_ids and done.text == plain.text
    assert done.stats.stop_reason == plain.stats.stop_reason
    ref, ended = reference(pair, ids, max_new)
    assert list(done.target_ids) == ref
    assert (done.stats.stop_reason == "eos") == ended


def emitted(rounds: list[Round]):
    return [p for r in rounds for p in r.emitted]


def assert_pieces_are_the_text(rounds, done) -> None:
    pieces = emitted(rounds)
    assert [p.target_id for p in pieces] == list(done.target_ids)
    assert "".join(p.text for p in pieces) == done.text
    assert not any("\ufffd" in p.text for p in pieces)


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------------------
# the drafter proposes end-of-sequence


@pytest.mark.parametrize("algorithm", SPEC)
def test_drafter_proposes_eos_and_the_target_accepts_it(tok, drafts, algorithm):
    tt, dt = tok[QWEN], tok[SMOL]
    words = " one two three"
    eos_t, eos_d = tt.eos_token_id, dt.eos_token_id
    pair, ids, dids = scripted_pair(tt, dt, "Count:", enc(tt, words) + [eos_t], enc(dt, words) + [eos_d])
    # the drafter's eos is the target's eos, for tli through the shared vocabulary
    assert pair.eos_ids() == {eos_t} and tt.decode([eos_t]) == dt.decode([eos_d]) == EOS_STRING
    d_ids, t_ids, _ = pair.intersection()
    assert eos_d in d_ids.tolist() and int(t_ids[d_ids.tolist().index(eos_d)]) == eos_t

    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=8, max_new_tokens=10)
    # it happened: one round drafted the words then eos, and the target kept all of it
    assert drafts[0] == enc(tt, words) + [eos_t]
    assert len(rounds) == 1 and rounds[0].drafted == rounds[0].accepted == 4
    assert [p.kind for p in rounds[0].pieces] == ["accepted"] * 3  # eos is not shown: it ends the answer
    assert done.stats.stop_reason == "eos" and done.text == words and EOS_STRING not in done.text
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 10)


@pytest.mark.parametrize("algorithm", SPEC)
def test_drafter_proposes_eos_and_the_target_rejects_it(tok, drafts, algorithm):
    tt, dt = tok[QWEN], tok[SMOL]
    eos_t, eos_d = tt.eos_token_id, dt.eos_token_id
    pair, ids, dids = scripted_pair(
        tt, dt, "Count:", enc(tt, " one two three four") + [eos_t], enc(dt, " one two") + [eos_d]
    )
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=8, max_new_tokens=10)
    # it happened: eos drafted third, shown rejected, and the target said " three" instead
    assert drafts[0] == enc(tt, " one two") + [eos_t]
    first = rounds[0]
    assert (first.drafted, first.accepted) == (3, 2)
    assert [(p.kind, p.target_id) for p in first.pieces] == [
        ("accepted", enc(tt, " one")[0]),
        ("accepted", enc(tt, " two")[0]),
        ("rejected", eos_t),
        ("resampled", enc(tt, " three")[0]),
    ]
    assert first.pieces[2].text == EOS_STRING
    assert done.stats.stop_reason == "eos" and done.text == " one two three four"
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 10)


# ---------------------------------------------------------------------------------------------------------------------
# the target ends mid-draft


@pytest.mark.parametrize("algorithm", SPEC)
def test_target_ends_mid_draft(tok, drafts, algorithm):
    tt, dt = tok[QWEN], tok[SMOL]
    eos_t = tt.eos_token_id
    pair, ids, dids = scripted_pair(
        tt, dt, "Count:", enc(tt, " one two three") + [eos_t], enc(dt, " one two three four five six")
    )
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=8, max_new_tokens=10)
    # it happened: the round drafted past " three", the target put eos where the drafter had " four"
    assert len(rounds) == 1
    last = rounds[0]
    assert drafts[0][:5] == enc(tt, " one two three four five")
    assert last.accepted == 3 and last.drafted >= 5
    kinds = [p.kind for p in last.pieces]
    assert kinds == ["accepted"] * 3 + ["rejected"] * (last.drafted - 3)  # no resampled piece: eos is not shown
    assert last.pieces[3].target_id == enc(tt, " four")[0]
    assert done.stats.stop_reason == "eos" and eos_t not in done.target_ids
    assert done.text == " one two three" and EOS_STRING not in done.text
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 10)


# ---------------------------------------------------------------------------------------------------------------------
# a token splits a multi-byte character


@pytest.mark.real_tokenization
@pytest.mark.parametrize("algorithm", ["none", *SPEC])
@pytest.mark.parametrize("drafted_text", [" 🎉 ok 🎊!", " 🌟 ok"], ids=["drafter-agrees", "drafter-diverges-mid-char"])
def test_split_multibyte_character_byte_level(tok, algorithm, drafted_text):
    tt, dt = tok[QWEN], tok[SMOL]
    answer = " 🎉 ok 🎊!"  # Qwen: 'ĠðŁ' 'İ' 'ī' 'Ġok' 'ĠðŁ' 'İ' 'Ĭ' '!': each emoji split over three tokens
    pair, ids, dids = scripted_pair(tt, dt, "Party:", enc(tt, answer) + [tt.eos_token_id], enc(dt, drafted_text))
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=3, max_new_tokens=16)
    tb = pair.target_bytes
    pieces = emitted(rounds)
    # it happened: tokens that are not whole characters were emitted, and their pieces waited for the rest
    assert sum(not is_utf8(bytes_of(tb, p.target_id)) for p in pieces) == 6
    assert [p.text for p in pieces] == [" ", "", "🎉", " ok", " ", "", "🎊", "!"]
    if drafted_text == " 🌟 ok" and algorithm != "none":
        # the drafter shares 'ĠðŁ' then diverges: a round ends inside 🎉, and the next one completes it
        committed, mid_char_round = b"", False
        for r in rounds:
            committed += b"".join(bytes_of(tb, p.target_id) for p in r.emitted)
            mid_char_round |= r is not rounds[-1] and not is_utf8(committed)
        assert mid_char_round
    assert done.text == answer and done.stats.stop_reason == "eos"
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 16)


@pytest.mark.real_tokenization
@pytest.mark.parametrize("algorithm", ["none", *SPEC])
def test_split_multibyte_character_byte_fallback(tok, algorithm):
    """Gemma spells 𓀀 in four <0xNN> byte-fallback tokens; SmolLM2 drafts the same four bytes in its byte alphabet."""
    tt, dt = tok[GEMMA], tok[SMOL]
    answer = " 𓀀 x"
    target_out = enc(tt, answer) + [tt.eos_token_id]
    assert tt.convert_ids_to_tokens(target_out[1:5]) == ["<0xF0>", "<0x93>", "<0x80>", "<0x80>"]
    pair, ids, dids = scripted_pair(tt, dt, "Hieroglyph:", target_out, enc(dt, answer))
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=3, max_new_tokens=12)
    pieces = emitted(rounds)
    assert [p.text for p in pieces] == [" ", "", "", "", "𓀀", " x"]
    if algorithm == "tli":  # the drafter's byte-level pieces map onto the target's byte-fallback tokens
        assert [p.kind for p in pieces[:3]] == ["accepted"] * 3 and pieces[1].target_id == target_out[1]
    assert done.text == answer
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 12)


@pytest.mark.real_tokenization
@pytest.mark.parametrize("algorithm", ["none", *SPEC])
def test_max_new_tokens_inside_a_character_holds_the_partial_piece_back(tok, algorithm):
    tt, dt = tok[QWEN], tok[SMOL]
    answer = " 🎉 ok"
    pair, ids, dids = scripted_pair(tt, dt, "Party:", enc(tt, answer) + [tt.eos_token_id], enc(dt, answer))
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=4, max_new_tokens=2)
    assert list(done.target_ids) == enc(tt, answer)[:2] and done.stats.stop_reason == "max_tokens"
    assert [p.text for p in emitted(rounds)] == [" ", ""]  # never a U+FFFD piece
    assert done.text == " \ufffd"  # the final text shows the cut character as the tokenizer decodes it
    assert_plain(pair, ids, dids, done, 2)


# ---------------------------------------------------------------------------------------------------------------------
# the prompt (and the answer) hold text the drafter's vocabulary cannot express


@pytest.mark.real_tokenization
@pytest.mark.parametrize("algorithm", SPEC)
def test_tokens_outside_the_shared_vocabulary(tok, drafts, algorithm):
    """For TLI "cannot express" means target tokens outside the shared vocabulary I: Qwen's FIM special tokens (SmolLM2
    spells them as plain characters) and whole CJK words (SmolLM2 only has their bytes)."""
    tt, dt = tok[QWEN], tok[SMOL]
    prompt = "<|fim_prefix|>def greet():<|fim_suffix|>\n<|fim_middle|>"
    fim_middle = tt.convert_tokens_to_ids("<|fim_middle|>")
    target_out = enc(tt, " 你好") + [fim_middle] + enc(tt, " 世界 ok") + [tt.eos_token_id]
    pair, ids, dids = scripted_pair(tt, dt, prompt, target_out, enc(dt, " 你好<|fim_middle|> 世界 ok"))
    _, t_ids, _ = pair.intersection()
    shared = set(t_ids.tolist())
    outside_prompt = [t for t in ids if t not in shared]
    outside_answer = [t for t in target_out if t not in shared]
    assert tt.convert_tokens_to_ids("<|fim_prefix|>") in outside_prompt and fim_middle in outside_prompt
    assert enc(tt, " 你好")[1] in outside_answer and fim_middle in outside_answer
    assert "<|fim_prefix|>" not in dt.convert_ids_to_tokens(dids)  # the drafter sees characters, not the token

    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=8, max_new_tokens=16)
    pieces = emitted(rounds)
    accepted_outside = [p for p in pieces if p.kind == "accepted" and p.target_id not in shared]
    if algorithm == "tli":  # tli can never draft them: the target supplies every one itself
        assert drafts and all(t in shared for d in drafts for t in d)
        assert not accepted_outside and {p.target_id for p in pieces} >= set(outside_answer)
    else:  # slem drafts text, and the target's tokenizer turns it into the whole CJK word
        assert enc(tt, " 你好")[1] in {p.target_id for p in accepted_outside}
    assert done.text == " 你好<|fim_middle|> 世界 ok" and done.stats.stop_reason == "eos"
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 16)


# ---------------------------------------------------------------------------------------------------------------------
# max_new_tokens hit inside a round


@pytest.mark.real_tokenization
@pytest.mark.parametrize("algorithm", SPEC)
def test_max_new_tokens_inside_a_round(tok, algorithm):
    tt, dt = tok[QWEN], tok[SMOL]
    words = " one two three four five six seven eight nine"
    pair, ids, dids = scripted_pair(tt, dt, "Count:", enc(tt, words) + [tt.eos_token_id], enc(dt, words))
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=8, max_new_tokens=3)
    assert len(rounds) == 1 and rounds[0].accepted > 3  # the round would have emitted more
    assert [(p.kind, p.text) for p in rounds[0].pieces] == [
        ("accepted", " one"),
        ("accepted", " two"),
        ("accepted", " three"),
    ]
    assert len(done.target_ids) == 3 and done.stats.tokens == 3 and done.stats.stop_reason == "max_tokens"
    assert list(done.target_ids) == enc(tt, words)[:3]
    assert_pieces_are_the_text(rounds, done)
    assert_plain(pair, ids, dids, done, 3)


# ---------------------------------------------------------------------------------------------------------------------
# plain decoding


@pytest.mark.parametrize("k", ["auto", 4])
def test_algorithm_none_drafts_nothing_whatever_the_draft_length(tok, monkeypatch, k):
    tt, dt = tok[QWEN], tok[SMOL]
    words = " one two three four five"
    pair, ids, dids = scripted_pair(tt, dt, "Count:", enc(tt, words) + [tt.eos_token_id], enc(dt, words))

    def no_drafting(*args, **kwargs):
        raise AssertionError("plain decoding drafted")

    monkeypatch.setattr(usd.drafters, "draft_tokens", no_drafting)
    monkeypatch.setattr(usd.drafters, "draft_strings", no_drafting)
    rounds, done = run(pair, ids, dids, algorithm="none", k=k, max_new_tokens=8, probe_first=True)
    assert all(r.k == 0 and r.drafted == 0 and r.algorithm == "none" for r in rounds)
    assert all(p.kind == "target" for r in rounds for p in r.pieces)
    assert (
        done.stats.algorithm == "none"
        and done.stats.drafted == 0
        and done.stats.rounds_by_algorithm == {"none": len(rounds)}
    )
    assert len(rounds) == len(done.target_ids) + 1  # one target step per token, and the one that said eos
    assert done.text == words
    assert_plain(pair, ids, dids, done, 8)


# ---------------------------------------------------------------------------------------------------------------------
# the models are never modified: cancellation, sampling


def fingerprint(model, full: bool = True) -> tuple:
    """Everything a change to the model would show: the modules, each parameter object and its in-place version
    counter, shapes, the embeddings, and a hash of the weights (all of them, or the LM head's only)."""
    h = hashlib.sha256()
    tensors = (
        list(model.named_parameters()) + list(model.named_buffers())
        if full
        else [("lm_head", model.get_output_embeddings().weight)]
    )
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    return (
        h.hexdigest(),
        [(n, id(p), p._version, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
        [(n, type(m).__name__) for n, m in model.named_modules()],
        id(out_emb),
        tuple(out_emb.weight.shape),
        id(in_emb),
        tuple(in_emb.weight.shape),
        model.config.to_dict(),
    )


@pytest.mark.parametrize("algorithm", SPEC)
def test_cancel_after_the_second_round_leaves_the_models_usable(tok, algorithm):
    tt, dt = tok[QWEN], tok[SMOL]
    words = " one two three four five six seven eight nine ten"
    pair, ids, dids = scripted_pair(tt, dt, "Count:", enc(tt, words) + [tt.eos_token_id], enc(dt, " one two six"))
    before = fingerprint(pair.target), fingerprint(pair.drafter)
    _, plain_before = run(pair, ids, dids, algorithm="none", max_new_tokens=16)

    cancel = threading.Event()
    events = []
    for event in stream(pair, ids, dids, how(algorithm=algorithm, k=2, max_new_tokens=16), cancel=cancel):
        events.append(event)
        if sum(isinstance(e, Round) for e in events) == 2:
            cancel.set()
    rounds, done = events[:-1], events[-1]
    assert isinstance(done, Finished) and len(rounds) == 2 and done.stats.rounds == 2
    assert done.stats.stop_reason == "cancelled"
    assert 0 < len(done.target_ids) < len(plain_before.target_ids)
    assert list(done.target_ids) == list(plain_before.target_ids[: len(done.target_ids)])
    assert_pieces_are_the_text(rounds, done)

    # a consumer that simply walks away (closes the generator mid-round) leaves nothing behind either
    walked_away = stream(pair, ids, dids, how(algorithm=algorithm, k=2, max_new_tokens=16))
    next(walked_away)
    walked_away.close()

    assert (fingerprint(pair.target), fingerprint(pair.drafter)) == before
    _, plain_after = run(pair, ids, dids, algorithm="none", max_new_tokens=16)
    assert plain_after.target_ids == plain_before.target_ids and plain_after.text == words
    _, again = run(pair, ids, dids, algorithm=algorithm, k=2, max_new_tokens=16)
    assert again.target_ids == plain_before.target_ids and again.stats.stop_reason == "eos"


def test_a_cancel_set_before_the_start_ends_at_once(tok):
    tt, dt = tok[QWEN], tok[SMOL]
    pair, ids, dids = scripted_pair(tt, dt, "Count:", enc(tt, " one two") + [tt.eos_token_id], None)
    cancel = threading.Event()
    cancel.set()
    rounds, done = run(pair, ids, dids, algorithm="tli", k=2, max_new_tokens=8, cancel=cancel)
    assert rounds == [] and done.target_ids == () and done.stats.stop_reason == "cancelled"


def test_no_algorithm_modifies_the_models_under_sampling(tok):
    tq, ts = tok[QWEN], tok[SMOL]
    words = " one two three four five six seven eight"
    # margin 12 over a 152k vocabulary: the scripted token is likely, not certain, so the draws matter
    cross = scripted_pair(tq, ts, "Count:", enc(tq, words) + [tq.eos_token_id], enc(ts, " one two five six"), 12.0)
    same = scripted_pair(tq, tq, "Count:", enc(tq, words) + [tq.eos_token_id], enc(tq, " one two five six"), 12.0)
    for (pair, ids, dids), algorithms in ((cross, ("tli", "slem", "auto")), (same, ("standard", "auto"))):
        before = fingerprint(pair.target), fingerprint(pair.drafter)
        drafted = accepted = 0
        for seed, algorithm in enumerate(algorithms):
            pair.memory.clear()  # so that auto tries every mode again
            params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
            _, done = run(pair, ids, dids, algorithm=algorithm, k=3, params=params, max_new_tokens=8)
            assert 0 < len(done.target_ids) <= 8
            drafted += done.stats.drafted
            accepted += done.stats.accepted
        assert 0 < accepted < drafted  # both the accept and the reject paths ran
        assert (fingerprint(pair.target), fingerprint(pair.drafter)) == before
        # and a greedy run after all that sampling (transformers' sampling path breaks this) is still plain greedy
        _, done = run(pair, ids, dids, algorithm=algorithms[0], k=3, max_new_tokens=8)
        assert done.stats.drafted > 0
        assert_plain(pair, ids, dids, done, 8)


# ---------------------------------------------------------------------------------------------------------------------
# invalid UTF-8 in the answer, and a drafter resync that would cut a character


def byte_token(tb, value: int) -> int:
    return min(i for i, b in tb.bytes_of.items() if b == bytes([value]))


@pytest.mark.parametrize("algorithm", ["none", *SPEC])
def test_invalid_utf8_in_the_answer_neither_blanks_the_stream_nor_blinds_the_drafter(tok, algorithm):
    """A lone continuation byte (as a sampled partial character leaves) sits early in the answer: every later piece
    still shows its text, the pieces add up to the text (the byte as U+FFFD), and the drafter keeps drafting well."""
    tt, dt = tok[QWEN], tok[SMOL]
    pair0, *_ = scripted_pair(tt, dt, "Say:", enc(tt, " ok"), None)
    bad_t, bad_d = byte_token(pair0.target_bytes, 0x80), byte_token(pair0.drafter_bytes, 0x80)
    words = " and then the rest of the answer goes on here"
    pair, ids, dids = scripted_pair(
        tt,
        dt,
        "Say:",
        enc(tt, " ok") + [bad_t] + enc(tt, words) + [tt.eos_token_id],
        enc(dt, " ok") + [bad_d] + enc(dt, words) + [dt.eos_token_id],
    )
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=4, max_new_tokens=40)
    assert done.text == " ok\ufffd" + words and done.stats.stop_reason == "eos"
    pieces = emitted(rounds)
    assert "".join(p.text for p in pieces) == done.text
    assert all(p.text for p in pieces)
    if algorithm != "none":  # the drafter followed the text past the invalid byte: most later tokens were drafted
        assert done.stats.accepted >= len(enc(tt, words)) - 4
    assert_plain(pair, ids, dids, done, 40)


@pytest.mark.parametrize("committed", ["é tail".encode(), b" ok\x80 and more", "日本語です".encode()])
def test_drafter_resync_spells_the_committed_bytes_and_never_cuts_a_character(tok, committed):
    """sync_drafter's one-token back-off can land inside a character when the drafter spelled it in byte tokens;
    it backs off to the character's start, and invalid bytes reach the drafter as its own byte tokens."""
    from usd.drafters import sync_drafter
    from usd.runners.transformers import Context

    tt, dt = tok[QWEN], tok[SMOL]
    pair, _, dids = scripted_pair(tt, dt, "Say:", enc(tt, " ok"), None)
    db = pair.drafter_bytes
    drafter = Context(pair.drafter, dids)
    # the drafter's own context: the first character in single-byte tokens, so the back-off lands inside it
    first = committed[: 2 if committed[0] >= 0x80 else 1]
    drafter.ids += [byte_token(db, b) for b in first]
    sync_drafter(pair, drafter, len(dids), [], committed)
    assert b"".join(bytes_of(db, i) for i in drafter.ids[len(dids) :]) == committed


# ---------------------------------------------------------------------------------------------------------------------
# context limits: a drafter with learned positions and a shorter context than the target's, and the verify positions


def gpt2_like(tokenizer, positions: int, seed: int):
    """A tiny model with learned absolute positions: feeding it past `positions` raises an IndexError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=positions,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("algorithm", SPEC)
@pytest.mark.parametrize("prompt_words", [3, 40], ids=["fills-mid-answer", "full-from-the-start"])
def test_a_drafter_with_a_short_context_stops_drafting_instead_of_crashing(tok, algorithm, prompt_words):
    tt, dt = tok[QWEN], tok[SMOL]
    pair, _, _ = scripted_pair(tt, dt, "x", enc(tt, " ok"), None)
    pair.drafter = gpt2_like(dt, positions=32, seed=1)
    prompt = "Count:" + " one" * prompt_words
    ids, dids = tt.encode(prompt), dt.encode(prompt)
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=4, max_new_tokens=40)
    assert done.stats.drafting_stopped and "drafter's context (32 tokens) is full" in done.stats.drafting_stopped
    assert rounds[-1].algorithm == "none"
    if prompt_words == 40:
        assert done.stats.drafted == 0
    assert_plain(pair, ids, dids, done, 40)


@pytest.mark.parametrize("algorithm", SPEC)
def test_verify_positions_stay_inside_the_targets_context(tok, algorithm):
    """prompt + max new tokens fits the target's context exactly; the k verify positions past the last committed
    token must not run over it near the end (a learned-position target would crash there)."""
    tt, dt = tok[QWEN], tok[SMOL]
    pair, _, _ = scripted_pair(tt, dt, "x", enc(tt, " ok"), None)
    ids, dids = tt.encode("Count: one"), dt.encode("Count: one")
    max_new = 20
    pair.target = gpt2_like(tt, positions=len(ids) + max_new, seed=0)
    pair.context_length = len(ids) + max_new
    pair.drafter = gpt2_like(dt, positions=256, seed=1)
    _, done = run(pair, ids, dids, algorithm=algorithm, k=8, max_new_tokens=max_new)
    assert done.stats.tokens == max_new or done.stats.stop_reason == "eos"
    assert done.stats.drafting_stopped is None
    _, plain = run(pair, ids, dids, algorithm="none", max_new_tokens=max_new)
    assert done.target_ids == plain.target_ids


@pytest.mark.parametrize("algorithm", SPEC)
def test_live_numbers_are_the_final_numbers(tok, algorithm):
    """Every Round carries the running Stats, counted as the final ones are: the last round's equal Finished's."""
    tt, dt = tok[QWEN], tok[SMOL]
    words = " one two three four five six"
    pair, ids, dids = scripted_pair(tt, dt, "Count:", enc(tt, words) + [tt.eos_token_id], enc(dt, " one two four"))
    rounds, done = run(pair, ids, dids, algorithm=algorithm, k=3, max_new_tokens=20, probe_first=True)
    last, final = rounds[-1].stats, done.stats
    for field in ("rounds", "drafted", "accepted", "tokens", "c", "v", "mean_k", "rounds_by_algorithm", "step_s"):
        assert getattr(last, field) == getattr(final, field), field
    assert [r.stats.rounds for r in rounds] == list(range(1, len(rounds) + 1))
    assert sum(r.draft_steps for r in rounds) > 0 and final.drafted > 0
