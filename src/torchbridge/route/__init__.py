"""`torchbridge.route`: a cache-aware endpoint picker in front of OpenAI-compatible replicas.

It speaks HTTP only (never imports the engine), so the replicas can be ours, vLLM or SGLang.
Modules: config (YAML profiles), tokenize (prompt -> tokens), index (chained block hashes and
per-replica prefix indexes), state (pool load table), scorers (filters/scorers/pickers),
picker (the decision procedure shared by proxy and simulator), replicas (HTTP pool: health,
scraping, KV events), proxy (the FastAPI app), metrics, simulator, calibrate, cli.
"""
