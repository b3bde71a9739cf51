"""usd-chat's Gradio UI. It only consumes what the `usd` engine yields."""
