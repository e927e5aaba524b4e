"""The OpenAI-compatible HTTP API, one module per endpoint group: `completions`, `chat`, `status`
(health, metrics, models, KV events); `context` holds what they share (engine, auth, request parsing),
`errors` the one place where failures become OpenAI-style error responses. `torchbridge.serve.server`
assembles the app."""
