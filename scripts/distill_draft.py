"""Distil a draft model for speculative decoding from a target checkpoint (default: the bundled model).

The draft is a shallower Llama with the target's tokenizer and vocabulary, its tied embedding copied
from the target (so it starts out speaking the target's token space), trained to match the target's
next-token distributions: loss = KL(p_target || q_draft) per token, on the training split of the same
offline corpus the target learned from (the interpreter's standard library sources, torchbridge.train's
data module), plus, with --self-generated, continuations sampled from the target itself (what the draft
will be asked to predict while serving). Acceptance of a draft token under speculative sampling is
sum_x min(p(x), q(x)) = 1 - TV(p, q), so the KL objective (which bounds TV by Pinsker) is the right one.

It writes a Hugging Face checkpoint (config, safetensors, the target's tokenizer files) that
`torchbridge serve --speculative-config '{"model": DIR, "num_speculative_tokens": 4}'` loads, and
reports the held-out KL and the greedy agreement rate (how often the draft's argmax is the target's:
the acceptance rate of greedy requests, about).

With --method eagle it trains an EAGLE head instead (serve/models/eagle.py): `fc` and one decoder layer
on top of the target's own final hidden states, the target's embedding and LM head frozen and not saved;
loss = KL(p_target || q_head) + smooth-L1 between the predicted and the target's next feature (EAGLE's
two terms). --unroll 2 also trains on the head's own predicted features as input (what it reads from its
second draft on). Serve it with '{"method": "eagle", "model": DIR, "num_speculative_tokens": 4}'.

    python scripts/distill_draft.py --out /tmp/draft --minutes 2          # a smoke run
    python scripts/distill_draft.py --out src/torchbridge/assets/default-draft --minutes 60

What a useful draft would take here: the target (4 layers, hidden 256, vocab 4,096) took ~70 CPU-
minutes to train. A 1-layer draft of the same width costs ~45% of the target's multiply-adds per
token (the 4,096 x 256 output layer, which both have, dominates), so on this CPU a draft pays only if it
agrees with the target on most tokens: ~3 draft tokens accepted per verifying step at k = 4 needs a
per-token acceptance near 0.75-0.8. Expect tens of minutes to a few hours of distillation on 2 cores
for that (not run in this session; see the report printed at the end of a run).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def draft_config(target_cfg: dict, layers: int, intermediate: int | None) -> dict:
    cfg = dict(target_cfg)
    cfg["num_hidden_layers"] = layers
    if intermediate:
        cfg["intermediate_size"] = intermediate
    cfg["tie_word_embeddings"] = True
    cfg["dtype"] = "float32"
    return cfg


def token_stream(tokenizer: object, max_bytes: int, split: str) -> torch.Tensor:
    from torchbridge.train.data import encode_stream, read_split

    docs = read_split(split, max_bytes)
    return encode_stream(tokenizer, [text for _, text in docs]).long()


def windows(stream: torch.Tensor, seq_len: int, batch: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def sampled_continuations(target: torch.nn.Module, prompts: torch.Tensor, new: int, g: torch.Generator) -> torch.Tensor:
    """The target's own text: prompts [B, L] continued by `new` tokens sampled at temperature 1."""
    ids = prompts
    for _ in range(new):
        probs = target(ids).logits[:, -1].float().softmax(-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids


def kl_and_agreement(target: torch.nn.Module, draft: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        p_logits = target(ids).logits.float()
    q_logits = draft(ids).logits.float()
    log_p, log_q = F.log_softmax(p_logits, -1), F.log_softmax(q_logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    agree = float((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean())
    return kl, agree


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from torchbridge.serve import default_model_dir
    from torchbridge.train.eagle_head import EagleHead, eagle_loss

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=default_model_dir())
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--method", choices=("draft_model", "eagle"), default="draft_model")
    ap.add_argument("--unroll", type=int, default=2, help="eagle: passes over the head's own predictions")
    ap.add_argument("--init", type=Path, default=None, help="eagle: continue from this head checkpoint")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    ap.add_argument("--minutes", type=float, default=5.0, help="training time budget")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--corpus-bytes", type=int, default=8_000_000)
    ap.add_argument("--self-generated", type=float, default=0.25,
                    help="fraction of batches that are the target's own sampled continuations")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(str(args.target))
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    target_cfg = json.loads((args.target / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in draft_config(target_cfg, args.layers, args.intermediate_size).items()
                         if k not in ("architectures", "transformers_version")})
    for p in target.parameters():
        p.requires_grad_(False)
    if args.method == "eagle":
        cfg.num_hidden_layers = 1
        draft = EagleHead(cfg, target)
        with torch.no_grad():  # start from the target's last layer (its input norm is dropped), or a head
            draft.body.layers[0].load_state_dict(target.model.layers[-1].state_dict(), strict=False)
            if args.init is not None:
                from safetensors.torch import load_file

                state = {k: v.float() for k, v in load_file(str(args.init / "model.safetensors")).items()}
                draft.fc.weight.copy_(state.pop("fc.weight"))
                draft.body.layers.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})

        def loss_of(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
            return eagle_loss(target, draft, ids, args.unroll)
    else:
        draft = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # start from the target's embedding (tied: also its output layer) and final norm
            draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
            draft.model.norm.weight.copy_(target.model.norm.weight)

        def loss_of(ids: torch.Tensor) -> tuple[torch.Tensor, float]:
            return kl_and_agreement(target, draft, ids)
    n_params = sum(p.numel() for p in draft.parameters())
    print(f"draft: {args.layers} layer(s), {n_params / 1e6:.2f}M parameters; target "
          f"{sum(p.numel() for p in target.parameters()) / 1e6:.2f}M", flush=True)

    train = token_stream(tok, args.corpus_bytes, "train")
    heldout = token_stream(tok, 400_000, "heldout")
    eval_ids = windows(heldout, args.seq_len, 8, torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    deadline = time.monotonic() + args.minutes * 60
    step, t0 = 0, time.monotonic()
    while time.monotonic() < deadline:
        frac = min(1.0, (time.monotonic() - t0) / (args.minutes * 60))
        for group in opt.param_groups:  # warm-up then cosine decay over the time budget
            group["lr"] = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * frac))
        if torch.rand((), generator=g) < args.self_generated:
            prompts = windows(train, 32, args.batch_size // 2, g)
            ids = sampled_continuations(target, prompts, args.seq_len // 4, g)
        else:
            ids = windows(train, args.seq_len, args.batch_size, g)
        loss, agree = loss_of(ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step}: KL {float(loss):.4f}, greedy agreement {agree:.3f}", flush=True)
    draft.eval()
    with torch.no_grad():
        kl, agree = loss_of(eval_ids)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.method == "eagle":
        from safetensors.torch import save_file

        save_file(draft.state_for_checkpoint(), str(args.out / "model.safetensors"))
        (args.out / "config.json").write_text(json.dumps(
            {**{k: v for k, v in target_cfg.items() if k != "dtype"}, "num_hidden_layers": 1, "dtype": "float32",
             "architectures": ["LlamaForCausalLM"]}, indent=2) + "\n")
    else:
        draft.save_pretrained(args.out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (args.target / f).is_file():
            shutil.copy(args.target / f, args.out / f)
    summary = {"target": str(args.target), "method": args.method, "layers": 1 if args.method == "eagle" else args.layers,
               "parameters": n_params, "steps": step,
               "minutes": round((time.monotonic() - t0) / 60, 2),
               # eagle: KL + the features' smooth-L1, averaged over the unrolled passes
               "heldout_kl" if args.method == "draft_model" else "heldout_loss": round(float(kl), 4),
               "heldout_greedy_agreement": round(agree, 4)}
    (args.out / "distill_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
