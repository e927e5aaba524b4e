"""A TorchTitan-class trainer: `python -m torchbridge train` (cli.py).

  config.py       TOML -> typed, validated sections (unknown keys and bad degrees named before any rank starts)
  data.py         the offline corpus (stdlib sources + chat and tool-call conversations), tokenizer, batches
  model.py        Hugging Face's LlamaForCausalLM from the [model] section; FLOPs per token
  parallelize.py  TP, activation checkpointing, torch.compile, FSDP2: applied outside model code
  checkpoint.py   torch.distributed.checkpoint save and exact resume
  metrics.py      loss, tokens/s, MFU, memory: progress bar, log lines, metrics.jsonl, TensorBoard
  export.py       the result as a Hugging Face checkpoint (what `serve --model DIR` loads)
  trainer.py      one rank's loop; cli.py validates, prepares data, then runs 1 rank or launches N
  configs/        shipped recipes: default.toml (the bundled model), tiny.toml (tests)
"""
