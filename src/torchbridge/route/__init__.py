"""`torchbridge.route`: a cache-aware endpoint picker in front of OpenAI-compatible replicas.

It speaks HTTP only (never imports the engine), so the replicas can be ours, vLLM or SGLang.
Modules: config (YAML profiles), prompt_tokens (prompt -> tokens), index (per-replica prefix indexes
over torchbridge.block_hash), load_table (the pool's load columns), scorers/ (filters, scorers and
pickers, one per module), sessions (the bounded session table), picker (the decision procedure shared by
proxy and simulator), replicas (HTTP pool: health, scraping, KV events), proxy (the FastAPI app),
supervisor (`up`'s process supervision), metrics, simulator, calibrate, cli. None imports torch or jax.
"""
