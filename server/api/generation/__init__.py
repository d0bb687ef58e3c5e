"""The pipeline every generating endpoint shares, whatever its protocol: request bodies parsed
into ChatRequest / CompletionRequest (protocol.py, messages.py, tools.py, structured.py), one
assistant turn rendered, constrained and started (turn.py), the engine stream with metrics
(pipeline.py), tool calls parsed from the text as it streams (tool_calls.py), logprob strings
(token_text.py). It serves no route."""
