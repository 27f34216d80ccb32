"""Hugging Face Trainer and Lightning: ckptstore against each stack's own checkpoint files.

Run from the repository root::

    python -m benchmarks.integrations.hf_lightning [--hidden 512] [--layers 8] [--steps 5] [--json OUT.json]

One GPT-2 model built from a config (no hub; ``--hidden``/``--layers``, fp32,
dropout 0.1) is fine-tuned for ``--steps`` optimizer steps with its
embeddings and the first half of its blocks frozen (AdamW on the rest), one
checkpoint after every step, in two stacks:

* ``hf``: ``transformers.Trainer`` (``save_steps=1``, every checkpoint kept)
  with :class:`ckptstore.integrations.hf.CkptStoreCallback` on a local
  ``file://`` repository. Trainer's own save of each step is timed from
  ``on_step_end`` to ``on_save`` (its ``_save_checkpoint`` runs in between);
  the callback's ``on_save`` is timed by itself. Restores of the last step:
  Trainer's reads (``safetensors.load_file`` of ``model.safetensors`` plus
  ``torch.load(optimizer.pt, weights_only=True)``) against ``repo.load`` on
  a fresh handle and against ``restore_checkpoint_dir`` (repository -> the
  folder Trainer resumes from); and ``from_pretrained(<folder>)`` against
  ``from_pretrained(None, state_dict=lazy_state_dict(url))``.
* ``lightning``: a ``LightningModule`` around the same model,
  ``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)``, once with
  Lightning's default ``TorchCheckpointIO`` (files) and once with
  :class:`~ckptstore.integrations.lightning.CkptStoreCheckpointIO`; each
  IO's ``save_checkpoint`` and ``load_checkpoint`` calls are timed.

Bytes stored: the size of the folders each stack wrote (all ``--steps``
checkpoints) against the size of the repository folder. Every restore is
compared with the model's final tensors; a difference exits 1. Loads read
files just written (page cache). See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time

import torch

from ..common.measure import Timer, dir_bytes, loadavg, median
from ..common.report import env_info, format_table, human, write_results
from ..common.verify import VerificationError, verify

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_model(hidden: int, layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=8192, n_positions=64, n_embd=hidden, n_layer=layers, n_head=max(1, hidden // 64))
    model = GPT2LMHeadModel(cfg)
    frozen = 0
    frozen_prefixes = ("transformer.wte", "transformer.wpe") + tuple(f"transformer.h.{i}." for i in range(layers // 2))
    for name, p in model.named_parameters():
        if name.startswith(frozen_prefixes):
            p.requires_grad_(False)
            frozen += p.numel() * p.element_size()
    return model, frozen


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 32):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 8192, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def check(expected: dict, got: dict, what: str) -> None:
    """Every tensor of ``expected`` in ``got``, bit for bit (``got`` may hold more)."""
    verify(expected, got, what, exact_keys=False)


def timed(fn):
    with Timer() as tm:
        out = fn()
    return tm.seconds, out


# ---------------------------------------------------------------- Hugging Face
def bench_hf(args, tmp: str) -> dict:
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import ckptstore
    from ckptstore.integrations import hf

    model, frozen = build_model(args.hidden, args.layers)
    url = os.path.join(tmp, "hf-repo")
    out_dir = os.path.join(tmp, "hf-out")
    own, ours, infos = [], [], []

    class OwnSaveTimer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_save(self, a, state, control, **kw):
            own.append(time.perf_counter() - self.t0)

    class TimedCallback(hf.CkptStoreCallback):
        def on_save(self, *a, **kw):
            t0 = time.perf_counter()
            super().on_save(*a, **kw)
            ours.append(time.perf_counter() - t0)
            infos.append(self.last_info.as_dict())

    cb = TimedCallback(url)
    targs = TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=2, learning_rate=1e-4,
        save_strategy="steps", save_steps=1, report_to=[], use_cpu=True, seed=0, logging_steps=10_000,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    # OwnSaveTimer first: its on_save runs before the ckptstore callback's.
    Trainer(model=model, args=targs, train_dataset=Tokens(2 * args.steps), callbacks=[OwnSaveTimer(), cb]).train()
    cb.close()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    last = os.path.join(out_dir, f"checkpoint-{args.steps}")

    t_files, (msd, _) = timed(lambda: (load_file(os.path.join(last, "model.safetensors")),
                                       torch.load(os.path.join(last, "optimizer.pt"), weights_only=True)))
    missing = [k for k in final if k not in msd]  # Trainer drops the tied lm_head.weight
    check({k: v for k, v in final.items() if k not in missing}, msd, "Trainer files")

    def repo_load():
        with ckptstore.open(url) as repo:
            return repo.load(args.steps)

    t_repo, sd = timed(repo_load)
    check(final, sd["model"], "repo.load")
    t_dir, resume = timed(lambda: hf.restore_checkpoint_dir(url, os.path.join(tmp, "hf-restore"), step=args.steps))
    t_fp_files, m1 = timed(lambda: GPT2LMHeadModel.from_pretrained(last))
    check(final, m1.state_dict(), "from_pretrained(folder)")

    def lazy_load():
        with hf.lazy_state_dict(url, args.steps) as lazy:
            return GPT2LMHeadModel.from_pretrained(None, config=model.config, state_dict=lazy)

    t_fp_lazy, m2 = timed(lazy_load)
    check(final, m2.state_dict(), "from_pretrained(lazy_state_dict)")
    trainer_bytes = sum(dir_bytes(os.path.join(out_dir, d)) for d in os.listdir(out_dir) if d.startswith("checkpoint-"))
    return {
        "logical_bytes": sum(v.numel() * v.element_size() for v in final.values()),
        "frozen_bytes": frozen,
        "save_seconds": {"trainer-files": own, "ckptstore": ours},
        "stored_bytes": {"trainer-files": trainer_bytes, "ckptstore": dir_bytes(url)},
        "restore_seconds": {
            "trainer-files (model.safetensors + optimizer.pt)": t_files,
            "ckptstore repo.load": t_repo,
            "ckptstore restore_checkpoint_dir": t_dir,
        },
        "from_pretrained_seconds": {"folder": t_fp_files, "lazy_state_dict": t_fp_lazy},
        "step_infos": infos,
        "resume_folder_bytes": dir_bytes(resume),
    }


# ---------------------------------------------------------------- Lightning
def bench_lightning(args, tmp: str) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from ckptstore.integrations.lightning import CkptStoreCheckpointIO

    class Wrapped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, _ = build_model(args.hidden, args.layers)

        def training_step(self, batch, i):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def timing(base):
        class Timed(base):
            saves: list = []
            loads: list = []

            def save_checkpoint(self, *a, **kw):
                t0 = time.perf_counter()
                super().save_checkpoint(*a, **kw)
                self.saves.append(time.perf_counter() - t0)

            def load_checkpoint(self, *a, **kw):
                t0 = time.perf_counter()
                out = super().load_checkpoint(*a, **kw)
                self.loads.append(time.perf_counter() - t0)
                return out

        Timed.saves, Timed.loads = [], []
        return Timed

    out = {"save_seconds": {}, "restore_seconds": {}, "stored_bytes": {}, "local_bytes": {}}
    systems = [
        ("torch-files", lambda: timing(TorchCheckpointIO)(), None),
        ("ckptstore", lambda: timing(CkptStoreCheckpointIO)(os.path.join(tmp, "lt-repo")), "lt-repo"),
        ("ckptstore-stub", lambda: timing(CkptStoreCheckpointIO)(os.path.join(tmp, "lt-repo-stub"), local_files="stub"),
         "lt-repo-stub"),
    ]
    for name, make, repo in systems:
        io = make()
        ckdir = os.path.join(tmp, f"lt-{name}")
        module = Wrapped()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, plugins=[io], default_root_dir=tmp,
            callbacks=[ModelCheckpoint(dirpath=ckdir, every_n_train_steps=1, save_top_k=-1)],
        )
        loader = torch.utils.data.DataLoader(Tokens(2 * args.steps), batch_size=2)
        trainer.fit(module, loader)
        final = {k: v.detach().clone() for k, v in module.state_dict().items()}
        ckpt = io.load_checkpoint(os.path.join(ckdir, f"epoch=0-step={args.steps}.ckpt"))
        check(final, ckpt["state_dict"], f"lightning {name}")
        out["save_seconds"][name] = list(io.saves)
        out["restore_seconds"][name] = io.loads[-1]
        out["local_bytes"][name] = dir_bytes(ckdir)
        out["stored_bytes"][name] = dir_bytes(ckdir) if repo is None else dir_bytes(os.path.join(tmp, repo))
        io.teardown()
    return out


# ---------------------------------------------------------------- report
def report(res: dict, command: str) -> None:
    hf_res, lt = res.get("hf"), res.get("lightning")
    if hf_res is not None:
        print(f"model: {human(hf_res['logical_bytes'])} of fp32 weights, {human(hf_res['frozen_bytes'])} frozen; "
              f"{res['steps']} fine-tuning steps, one checkpoint per step")
    rows = [("stack", "system", "save s (first, median of rest)", "restore s", f"bytes stored ({res['steps']} ckpts)",
             "local folder")]

    def save_cell(xs):
        return f"{xs[0]:.2f}, {median(xs[1:]):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"

    if hf_res is not None:
        hs, hr, hb = hf_res["save_seconds"], hf_res["restore_seconds"], hf_res["stored_bytes"]
        rows.append(("hf", "Trainer files", save_cell(hs["trainer-files"]),
                     f"{hr['trainer-files (model.safetensors + optimizer.pt)']:.2f}", human(hb["trainer-files"]), ""))
        rows.append(("hf", "CkptStoreCallback", save_cell(hs["ckptstore"]),
                     f"{hr['ckptstore repo.load']:.2f} (load) / {hr['ckptstore restore_checkpoint_dir']:.2f} (to folder)",
                     human(hb["ckptstore"]), ""))
    ls, lr, lb, ll = (lt or {}).get("save_seconds"), (lt or {}).get("restore_seconds"), (lt or {}).get("stored_bytes"), \
        (lt or {}).get("local_bytes")
    for key, label in () if lt is None else (("torch-files", "TorchCheckpointIO"), ("ckptstore", "CkptStoreCheckpointIO (local_files='full')"),
                       ("ckptstore-stub", "CkptStoreCheckpointIO (local_files='stub')")):
        rows.append(("lightning", label, save_cell(ls[key]), f"{lr[key]:.2f}", human(lb[key]), human(ll[key])))
    print(format_table(list(rows[0]), [list(r) for r in rows[1:]], left=len(rows[0]), rule=False))
    if hf_res is None:
        print(f"command: {command}")
        return
    fp = hf_res["from_pretrained_seconds"]
    print(f"from_pretrained of the last step: folder {fp['folder']:.2f} s, lazy_state_dict {fp['lazy_state_dict']:.2f} s")
    print("ckptstore StepInfo per save (hf):")
    for info in hf_res["step_infos"]:
        print(f"  step {info['step']}: uploaded {human(info['uploaded_bytes'])}, reused {human(info['reused_bytes'])}, "
              f"new {human(info['new_bytes'])} -> {human(info['stored_bytes'])}, {info['seconds']:.2f} s")
    print(f"command: {command}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the temp folder (printed)")
    p.add_argument("--only", choices=["hf", "lightning"], help="run one stack")
    args = p.parse_args(argv)
    command = "python -m benchmarks.integrations.hf_lightning " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"load average at start: {loadavg()}")
    tmp = tempfile.mkdtemp(prefix="ckpt-integ-bench-")
    try:
        res = {"steps": args.steps, "hidden": args.hidden, "layers": args.layers}
        if args.only != "lightning":
            res["hf"] = bench_hf(args, tmp)
        if args.only != "hf":
            res["lightning"] = bench_lightning(args, tmp)
    except VerificationError as e:
        print(f"VERIFICATION FAILED: {e}")
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(res, command)
    print(f"load average at end: {loadavg()}; env: {env_info()}")
    if args.json:
        write_results(args.json, command, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
