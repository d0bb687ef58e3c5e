"""The HTTP layer. app.py joins each sub-package's ROUTES; the modules here are the plumbing
they share (state, errors, body, fields, sse, auth, admission, pagination, owned objects,
usage, metrics). Imports point one way, each package only to those below it:

    app -> batch -> openai, anthropic, rerank, ops -> generation -> the plumbing here

A protocol package (openai, anthropic, rerank) never imports another; the batch queue runs
the first two.
"""
