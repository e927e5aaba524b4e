"""`torchbridge train` end to end on the tiny config (20 steps, a 107k-parameter Llama, seed 1234).

References: the same job on CPU tensors in plain PyTorch (the cpu run), and Hugging Face itself (the
first step's loss recomputed with a fresh LlamaForCausalLM; the exported checkpoint's generate()).
Tolerances: fp32 everywhere; device vs CPU losses within 1e-4 relative (measured ~1e-7: XLA and
PyTorch's CPU kernels reduce in different orders, and AdamW carries the difference on); data- and
tensor-parallel runs vs one rank within 1e-5 relative (measured <= 2e-7); a resumed run vs the
uninterrupted one within 1e-6 relative (measured: identical).

Default run: cpu and device (1 rank); resume; export. TB_SLOW=1 adds FSDP2 on 2 ranks, tp=2,
dp_shard=2 x tp=2 (4 ranks), and compiled / activation-checkpointed / bf16 jobs (each multi-rank job
takes 2-3 minutes on 2 cores: starting the ranks, JAX's distributed runtime, compiling every op)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from train_support import run_cli, run_here, tiny, with_data

import torchbridge

SLOW = os.environ.get("TB_SLOW") == "1"
needs_device = pytest.mark.skipif(torchbridge.registration_error() is not None,
                                  reason=f"device backend unavailable: {torchbridge.registration_error()}")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny config's tokenizer and streams, prepared once for every job of this module."""
    from torchbridge.train import data

    out = tmp_path_factory.mktemp("prepared")
    cfg = tiny(out)
    data.prepare(cfg.data, cfg.training.seed, out)
    return out


@pytest.fixture(scope="module")
def cpu_run(prepared, tmp_path_factory):
    out = with_data(tmp_path_factory.mktemp("cpu"), prepared)
    return out, run_here(out, **{"job.device": "cpu"})


def _assert_same_curve(got: dict[int, float], ref: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(ref)
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)]),
                               torch.tensor([ref[k] for k in sorted(ref)]), rtol=rtol, atol=0)


def test_cpu_run_trains_and_its_first_loss_is_hugging_faces(cpu_run):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from torchbridge.train import data, model

    out, s = cpu_run
    losses = s["losses"]
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 0.5 and s["heldout_losses"]["20"] < s["heldout_losses"]["10"]
    # step 1's loss, recomputed outside the trainer: a seeded HF Llama on the step's batch
    cfg = tiny(out)
    tokenizer = AutoTokenizer.from_pretrained(out / "data" / "tokenizer")
    torch.manual_seed(cfg.training.seed)
    ref = LlamaForCausalLM(model.hf_config(cfg.model, len(tokenizer), tokenizer)).float()
    batch = data.global_batch(data.load(out).train, cfg.data.seq_len, cfg.training.batch_size, cfg.training.seed, 1)
    with torch.no_grad():
        first = ref(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(first.flatten(0, 1), batch[:, 1:].flatten())
    assert losses[1] == pytest.approx(float(loss), rel=1e-6)
    # what a run reports: every step in metrics.jsonl and TensorBoard event files
    assert len((out / "metrics.jsonl").read_text().splitlines()) >= 20
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


@needs_device
def test_device_run_matches_cpu_run(cpu_run, prepared, tmp_path):
    out = with_data(tmp_path / "tpu", prepared)
    got = run_here(out, **{"job.device": torchbridge.device_name()})
    _assert_same_curve(got["losses"], cpu_run[1]["losses"], rtol=1e-4)


def test_resume_from_step_10_gives_the_same_losses(cpu_run, prepared, tmp_path):
    """A new job given only the step-10 checkpoint of the cpu run computes its steps 11-20."""
    first, ref = cpu_run
    out = with_data(tmp_path / "resumed", prepared)
    shutil.copytree(first / "checkpoints" / "step-10", out / "checkpoints" / "step-10")
    got = run_here(out, **{"job.device": "cpu"})
    assert got["first_step"] == 10
    _assert_same_curve(got["losses"], {k: v for k, v in ref["losses"].items() if k > 10}, rtol=1e-6)


def test_exported_checkpoint_is_the_trained_model_and_serves_like_hugging_face_generate(cpu_run):
    """Loaded by transformers, the export scores the held-out windows as the trainer did at its last step;
    the engine's greedy tokens on it are Hugging Face generate()'s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchbridge.serve import LLM, SamplingParams
    from torchbridge.train import data

    out, s = cpu_run
    model_dir = out / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = tiny(out)
    windows = data.eval_windows(data.load(out).heldout, cfg.data.seq_len, cfg.eval.windows)
    with torch.no_grad():
        logits = hf(input_ids=windows[:, :-1]).logits
    heldout = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    assert float(heldout) == pytest.approx(s["heldout_losses"]["20"], rel=1e-5)
    prompts = ["def ", "import os\n", "class Parser:\n    def __init__(self"]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        want = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, prompt


@needs_device
@pytest.mark.skipif(not SLOW, reason="a 2-rank job takes ~2 minutes on 2 cores: TB_SLOW=1")
def test_fsdp2_on_two_ranks_matches_one_rank(cpu_run, prepared, tmp_path):
    out = with_data(tmp_path / "fsdp2", prepared)
    got = run_cli(out, 2, torchbridge.device_name(), 0)
    assert got["ranks"] == 2
    _assert_same_curve(got["losses"], cpu_run[1]["losses"], rtol=1e-4)


@needs_device
@pytest.mark.skipif(not SLOW, reason="4-rank and tensor-parallel jobs take minutes: TB_SLOW=1")
@pytest.mark.parametrize("nproc, tp", [(2, 2), (4, 2)])
def test_tensor_parallel_and_2d_match_one_rank(cpu_run, prepared, tmp_path, nproc, tp):
    out = with_data(tmp_path / f"tp{nproc}", prepared)
    got = run_cli(out, nproc, torchbridge.device_name(), nproc, ["--set", f"parallel.tp={tp}"], timeout=900)
    assert got["ranks"] == nproc
    _assert_same_curve(got["losses"], cpu_run[1]["losses"], rtol=1e-4)


@needs_device
@pytest.mark.skipif(not SLOW, reason="compiled and mixed-precision jobs take minutes: TB_SLOW=1")
@pytest.mark.parametrize("kind", ["compiled", "checkpointed", "bf16"])
def test_compiled_checkpointed_and_bf16_jobs_train(cpu_run, prepared, tmp_path, kind):
    """Compiled (the device's backend), activation checkpointing: the curve of eager fp32 within 1e-3
    (compiled graphs round differently); bf16: within 3% (bf16 products), and it still trains."""
    device = torchbridge.device_name()
    ref = cpu_run[1]["losses"]
    sets = {"compiled": {"training.compile": True}, "checkpointed": {"training.activation_checkpointing": True},
            "bf16": {"training.mixed_precision": "bfloat16"}}[kind]
    run = run_here(with_data(tmp_path / kind, prepared), **{"job.device": device, **sets})
    _assert_same_curve(run["losses"], ref, rtol=3e-2 if kind == "bf16" else 1e-3)
    assert run["losses"][20] < run["losses"][1] - 0.5


@pytest.mark.skipif(not SLOW, reason="a compiled job takes minutes: TB_SLOW=1")
def test_compiled_and_checkpointed_job_trains(cpu_run, prepared, tmp_path):
    """AOTAutograd wraps the checkpointed layers' SDPA (tagged nondeterministic_seeded) in
    run_and_save_rng_state / run_with_rng_state: lowered by the backend (compile/rng_state.py)."""
    run = run_here(with_data(tmp_path / "compiled-ac", prepared), **{
        "job.device": torchbridge.device_name(), "training.compile": True, "training.activation_checkpointing": True})
    _assert_same_curve(run["losses"], cpu_run[1]["losses"], rtol=1e-3)
