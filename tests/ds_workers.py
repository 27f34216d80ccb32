"""Process bodies for the DeepSpeed integration tests (gloo on 127.0.0.1, CPU accelerator).

Kept in an importable module so torch.multiprocessing's spawn can find
them. Expected values travel between processes as torch.save files in the
test's tmp dir (test scaffolding only; the store never holds a pickle).
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

#: a frozen first layer (frozen parameters must upload nothing on later steps)
IN, HID, OUT = 32, 64, 8


def init(rank: int, world: int, port: int):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    import faulthandler

    faulthandler.enable(all_threads=True)
    import deepspeed
    import deepspeed.ops

    # The CPU accelerator would otherwise compile a shared-memory op with g++ (~75 s).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def shutdown():
    """Tear gloo down together, then leave without interpreter finalization.

    DeepSpeed keeps references to the process groups it created (engine,
    optimizer, ``deepspeed.utils.groups``); a gloo backend whose last
    reference goes during interpreter finalization can abort the process
    ("terminate called without an active exception"), which happened here
    once in about ten runs after every check had passed.
    """
    import sys

    import torch.distributed as dist

    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.ReLU(), torch.nn.Linear(HID, HID), torch.nn.ReLU(),
                            torch.nn.Linear(HID, OUT))
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    return m


class GroupStepAdamW(torch.optim.AdamW):
    """AdamW that also counts steps in its parameter groups, as DeepSpeed's own Adam implementations do.

    DeepSpeed's elastic ZeRO-1/2 checkpoints need it: they save and restore
    ``param_groups[0]["step"]`` (``base_optimizer_state_step``), which
    torch's optimizers keep per parameter only.
    """

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        return loss


def engine(deepspeed, stage: int, seed: int = 0, bf16: bool = False, zero: dict | None = None, m=None):
    m = model(seed) if m is None else m
    opt_cls = GroupStepAdamW if (zero or {}).get("elastic_checkpoint") else torch.optim.AdamW
    opt = opt_cls([p for p in m.parameters() if p.requires_grad], lr=0.01)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, **(zero or {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    eng, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    return eng


def train(eng, steps: int, seed: int) -> None:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(4, IN, generator=g)
        dt = next(p for p in eng.module.parameters()).dtype
        loss = eng(x.to(dt)).float().pow(2).mean()
        eng.backward(loss)
        eng.step()


def full_state(eng) -> dict:
    """Every parameter's full value, fp32 master, Adam moments (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # ZeRO-1/2 link optimizer-state fragments to parameters lazily at the
    # first step(); after a load, before any step, link them as step() would.
    getattr(eng.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    out = {}
    for name, p in eng.module.named_parameters():
        if p.requires_grad:
            out[f"{name}.fp32"] = safe_get_full_fp32_param(p).detach().clone()
            out[f"{name}.exp_avg"] = safe_get_full_optimizer_state(p, "exp_avg").detach().clone()
            out[f"{name}.exp_avg_sq"] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone()
        out[f"{name}.param"] = gathered(p)
    out["global_steps"] = torch.tensor(eng.global_steps)
    return out


def gathered(p) -> torch.Tensor:
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone()
    return p.detach().clone()


def adam_step(eng) -> torch.Tensor:
    opt = eng.optimizer.optimizer
    steps = {float(st["step"]) for st in opt.state.values() if "step" in st}
    assert len(steps) == 1, steps
    return torch.tensor(steps.pop())


def compare(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        small = f": {got[k]!r} != {want[k]!r}" if got[k].numel() <= 4 or want[k].numel() <= 4 else ""
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k} differs{small}"


# ------------------------------------------------------------------ workers
def save_load_worker(rank, world, port, stage, url, so, tmp, bf16=False):
    """Save at step 2 and 3; a fresh engine loads step 2 bit-exact and trains on like the original."""
    import torch.distributed as dist

    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    save_dir = os.path.join(tmp, "ds")
    eng = engine(deepspeed, stage, bf16=bf16)
    ce = cds.attach(eng, url, storage_options=so, chunk_size=4096)
    train(eng, 2, seed=1)
    want = full_state(eng)
    want_adam = adam_step(eng)
    eng.save_checkpoint(save_dir, tag="global_step2", client_state={"epoch": 7, "note": "hi"})
    stats2 = dict(ce.last_save)
    train(eng, 1, seed=2)
    after = full_state(eng)
    eng.save_checkpoint(save_dir)  # tag global_step3 (engine.global_steps)
    stats3 = dict(ce.last_save)
    if rank == 0:
        torch.save({"want": want, "after": after}, os.path.join(tmp, f"expect_{stage}.pt"))
        torch.save({"s2": stats2, "s3": stats3}, os.path.join(tmp, f"stats_{stage}.pt"))

    # A fresh engine (different init) resumes from step 2 and trains on exactly like the original.
    fresh = engine(deepspeed, stage, seed=5, bf16=bf16)
    cds.attach(fresh, url, storage_options=so)
    path, client = fresh.load_checkpoint(save_dir, tag="global_step2")
    assert path is not None, "load_checkpoint found nothing"
    assert client["epoch"] == 7 and client["note"] == "hi", client
    compare(full_state(fresh), want, f"rank {rank} stage {stage} after load")
    assert torch.equal(adam_step(fresh), want_adam)
    train(fresh, 1, seed=2)
    compare(full_state(fresh), after, f"rank {rank} stage {stage} after training on")
    dist.barrier()
    shutdown()


def reshard_worker(rank, world, port, url, so, tmp, bf16=False):
    """A fresh ZeRO-3 engine on ``world`` ranks loads a step saved on 2 and trains on."""
    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    exp = torch.load(os.path.join(tmp, "expect_3.pt"), weights_only=True)
    as_deepspeed = engine(deepspeed, 3, seed=9, bf16=bf16)
    cds.attach(as_deepspeed, url, storage_options=so, reshard=False)  # ZeRO-3 as DeepSpeed: refused
    try:
        as_deepspeed.load_checkpoint(os.path.join(tmp, f"as_deepspeed{world}"), tag="global_step2")
    except RuntimeError as e:
        # DeepSpeed's own failure: its module load copies the saved frozen partitions (2 ranks' size) first
        assert "must match the size" in str(e), e
    else:
        raise AssertionError("reshard=False re-partitioned a ZeRO-3 step")
    fresh = engine(deepspeed, 3, seed=9, bf16=bf16)
    cds.attach(fresh, url, storage_options=so)
    # A load directory that never saw the checkpoint: the stubs are written from the repository.
    path, client = fresh.load_checkpoint(os.path.join(tmp, f"elsewhere{world}"), tag="global_step2")
    assert path is not None
    assert client["epoch"] == 7
    compare(full_state(fresh), exp["want"], f"rank {rank} of {world} after resharded load")
    train(fresh, 1, seed=3)
    st = full_state(fresh)
    assert int(st["global_steps"]) == 3
    moved = [k for k in st if k.endswith(".fp32") and not torch.equal(st[k], exp["want"][k])]
    assert moved, "training after the resharded load changed nothing"
    shutdown()


def failure_worker(rank, world, port, url, so, tmp):
    """A plain DeepSpeed directory loads through an attached engine (restricted unpickler);
    an object ckptstore does not store fails on every rank and changes nothing."""
    import ckptstore
    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    legacy_dir = os.path.join(tmp, "plain_deepspeed")
    stock = engine(deepspeed, 2, seed=3)
    train(stock, 1, seed=4)
    stock.save_checkpoint(legacy_dir, tag="old")  # DeepSpeed's TorchCheckpointEngine, torch.save files
    want = full_state(stock)

    save_dir = os.path.join(tmp, "ds_fail")
    eng = engine(deepspeed, 2)
    cds.attach(eng, url, storage_options=so)
    path, _ = eng.load_checkpoint(legacy_dir, tag="old")
    assert path is not None
    compare(full_state(eng), want, f"rank {rank}: plain DeepSpeed checkpoint through the attached engine")
    train(eng, 1, seed=1)
    eng.save_checkpoint(save_dir, tag="global_step1")
    repo = ckptstore.open(url, storage_options=so)
    before = repo.steps()
    try:
        eng.save_checkpoint(save_dir, tag="global_step9", client_state={"bad": object()})
    except Exception as e:  # rank 0 names the value; the other rank says another rank failed
        assert "nothing was saved" in str(e), e
        if rank == 0:
            assert "bad" in str(e), e
    else:
        raise AssertionError("an unsupported client_state value did not fail")
    assert repo.steps() == before, (before, repo.steps())
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "global_step1"
    repo.close()
    shutdown()


def hf_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)


def hf_worker(rank, world, port, url, tmp):
    """A tiny Hugging Face GPT-2 (tied embeddings, one frozen block) trained and saved under ZeRO-3."""
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers import GPT2LMHeadModel

    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(hf_config())
    m.transformer.h[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    eng, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    cds.attach(eng, url)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 100, (2, 8), generator=g)
        eng.backward(eng(input_ids=ids, labels=ids).loss)
        eng.step()
    eng.save_checkpoint(os.path.join(tmp, "ds"), tag="global_step2")
    full = {n: safe_get_full_fp32_param(p).clone() if p.requires_grad else gathered(p)
            for n, p in eng.module.named_parameters()}
    if rank == 0:
        torch.save(full, os.path.join(tmp, "hf_full.pt"))
    shutdown()


# ------------------------------------------------------------------ every load path, DeepSpeed's tools
def params(eng) -> dict:
    """Every parameter's full value (collective under ZeRO-3)."""
    return {name: gathered(p) for name, p in eng.module.named_parameters()}


def module_only_worker(rank, world, port, url, tmp):
    """ZeRO-3 loads without optimizer states take the weights of the tag being loaded from the repository."""
    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    plain_dir, save_dir = os.path.join(tmp, "plain"), os.path.join(tmp, "ds")
    plain = engine(deepspeed, 3, seed=4)  # saved by DeepSpeed itself, before any attach
    train(plain, 1, seed=4)
    plain.save_checkpoint(plain_dir, tag="p")
    plain_params = params(plain)

    eng = engine(deepspeed, 3)
    cds.attach(eng, url)
    train(eng, 2, seed=1)
    at_a = params(eng)
    eng.save_checkpoint(save_dir, tag="a")
    train(eng, 1, seed=2)
    eng.save_checkpoint(save_dir, tag="b")  # `latest` says b; DeepSpeed's own consolidation would read b
    # DeepSpeed consolidates under ZeRO-3 when optimizer states are not loaded (its own tests pass both flags)
    for kwargs in ({"load_module_only": True, "load_optimizer_states": False}, {"load_optimizer_states": False}):
        for where in (save_dir, os.path.join(tmp, "fresh")):  # fresh: no `latest`, no stubs before the load
            fresh = engine(deepspeed, 3, seed=7)
            cds.attach(fresh, url)
            path, _ = fresh.load_checkpoint(where, tag="a", **kwargs)
            assert path is not None, (where, kwargs)
            compare(params(fresh), at_a, f"rank {rank}: tag a loaded with {kwargs} from {where}")
            if not kwargs.get("load_module_only"):
                assert fresh.global_steps == 2, fresh.global_steps
    # A load that is not ckptstore's goes to DeepSpeed's own consolidation (real files).
    other = engine(deepspeed, 3, seed=8)
    cds.attach(other, url)
    path, _ = other.load_checkpoint(plain_dir, tag="p", load_optimizer_states=False)
    assert path is not None
    compare(params(other), plain_params, f"rank {rank}: plain ZeRO-3 folder through an attached engine")
    shutdown()


class TiedModel(torch.nn.Module):
    """A frozen first layer, two layers sharing one weight, fp64 and int buffers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(IN, HID)
        self.b = torch.nn.Linear(HID, HID)
        self.c = torch.nn.Linear(HID, HID)
        self.c.weight = self.b.weight
        self.out = torch.nn.Linear(HID, OUT)
        self.a.requires_grad_(False)
        self.register_buffer("scale", torch.tensor([1.5, 0.5], dtype=torch.float64))
        self.register_buffer("seen", torch.tensor([3], dtype=torch.int64))

    def forward(self, x):
        h = torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x))))))
        return self.out(h) * self.scale.float().sum()


def tools_worker(rank, world, port, stage, url, tmp):
    """The same state saved by DeepSpeed itself (tmp/plain) and through ckptstore (tmp/ds), tag "t"."""
    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    eng = engine(deepspeed, stage, m=TiedModel())
    train(eng, 2, seed=1)
    eng.save_checkpoint(os.path.join(tmp, "plain"), tag="t")
    cds.attach(eng, url)
    eng.save_checkpoint(os.path.join(tmp, "ds"), tag="t")
    shutdown()


# ------------------------------------------------------------------ ZeRO-1/2 on another DP size
def partitions(eng) -> dict:
    """This rank's flat fp32 partitions and base optimizer state, as the optimizer holds them."""
    opt = eng.optimizer
    out = {}
    for i, t in enumerate(opt.single_partition_of_fp32_groups):
        out[f"fp32.{i}"] = t.detach().clone()
        for k, v in opt.optimizer.state[t].items():
            v = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
            # DeepSpeed's elastic restore (_restore_base_optimizer_state) gives a fresh optimizer its
            # 0-d "step" as a 1-element tensor, on any DP size: compare the count, not the shape.
            out[f"state.{i}.{k}"] = v.reshape(()) if k == "step" else v
    return out


def zero12_worker(rank, world, port, stage, url, tmp, phase, zero):
    """ZeRO-1/2 saved on 2 ranks ("save"), loaded on ``world`` ranks and saved there ("other"),
    loaded back on 2 ranks ("back"): bit-exact with the run that never changed size."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    from ckptstore.integrations import deepspeed as cds

    deepspeed = init(rank, world, port)
    save_dir = os.path.join(tmp, "ds")
    expect = os.path.join(tmp, "expect.pt")
    if phase == "save":
        eng = engine(deepspeed, stage, zero=zero)
        cds.attach(eng, url)
        train(eng, 2, seed=1)
        want = full_state(eng)
        torch.save(partitions(eng), os.path.join(tmp, f"partitions_{rank}.pt"))
        eng.save_checkpoint(save_dir, tag="s")
        train(eng, 1, seed=2)
        if rank == 0:
            torch.save({"want": want, "after": full_state(eng)}, expect)
        else:
            full_state(eng)
        dist.barrier()
        shutdown()
    exp = torch.load(expect, weights_only=True)
    if phase == "other":
        # default (reshard=None): ZeRO-1/2 behave as DeepSpeed, which refuses optimizer states on another DP size
        refused = engine(deepspeed, stage, seed=9, zero=zero)
        cds.attach(refused, url)
        try:
            refused.load_checkpoint(save_dir, tag="s")
        except ZeRORuntimeException as e:
            assert "DP world size of 2" in str(e) and cds.RESHARD_HINT in str(e), e
        else:
            raise AssertionError("optimizer states on another DP size loaded without reshard=True")
        weights_only = engine(deepspeed, stage, seed=9, zero=zero)
        cds.attach(weights_only, url)
        path, _ = weights_only.load_checkpoint(save_dir, tag="s", load_optimizer_states=False)
        assert path is not None and weights_only.global_steps == 2
        compare(params(weights_only), {k[: -len(".param")]: v for k, v in exp["want"].items() if k.endswith(".param")},
                f"rank {rank} of {world}: weights without optimizer states")
        eng = engine(deepspeed, stage, seed=9, zero=zero)
        cds.attach(eng, url, reshard=True)
        path, client = eng.load_checkpoint(save_dir, tag="s")
        assert path is not None
        compare(full_state(eng), exp["want"], f"rank {rank} of {world}: re-partitioned load")
        eng.save_checkpoint(save_dir, tag="r")  # saved on `world` ranks, nothing trained since the load
        shutdown()
    # "back": on 2 ranks again, from the step saved on `world`
    eng = engine(deepspeed, stage, seed=11, zero=zero)
    cds.attach(eng, url, reshard=True)
    path, _ = eng.load_checkpoint(save_dir, tag="r")
    assert path is not None
    compare(partitions(eng), torch.load(os.path.join(tmp, f"partitions_{rank}.pt"), weights_only=True),
            f"rank {rank}: partitions after 2 -> other -> 2")
    compare(full_state(eng), exp["want"], f"rank {rank}: back on 2 ranks")
    train(eng, 1, seed=2)
    compare(full_state(eng), exp["after"], f"rank {rank}: trained on after the round trip")
    shutdown()


# ------------------------------------------------------------------ a tag saved again
def resave_worker(rank, world, port, url, tmp):
    """A tag saved again loads the new state; the old step stays; steps without names load by the old rules."""
    import torch.distributed as dist

    import ckptstore
    from ckptstore.integrations import deepspeed as cds
    from ckptstore.integrations import deepspeed_tools as T

    deepspeed = init(rank, world, port)
    save_dir = os.path.join(tmp, "ds")
    eng = engine(deepspeed, 2)
    ce = cds.attach(eng, url)
    train(eng, 1, seed=1)
    first = full_state(eng)
    eng.save_checkpoint(save_dir)  # tag global_step1 -> step 1
    assert ce.last_step == 1, ce.last_step
    train(eng, 1, seed=2)
    second = full_state(eng)
    eng.save_checkpoint(save_dir, tag="global_step1")  # the same tag again: step 1 is taken
    assert ce.last_step == 2, ce.last_step  # every rank saved to the step rank 0 picked
    repo = ckptstore.open(url)
    assert repo.steps() == [1, 2], repo.steps()
    assert repo.name_step("deepspeed", "global_step1") == 2
    for f in os.listdir(os.path.join(save_dir, "global_step1")):
        assert T.read_stub(os.path.join(save_dir, "global_step1", f))["step"] == 2, f
    for where in (save_dir, os.path.join(tmp, "elsewhere")):
        fresh = engine(deepspeed, 2, seed=5)
        cds.attach(fresh, url)
        path, _ = fresh.load_checkpoint(where, tag="global_step1")
        assert path is not None
        compare(full_state(fresh), second, f"rank {rank}: tag saved again, loaded from {where}")
    # A tag that cannot be a checkpoint name (a '/') is saved without one and found by its stubs.
    train(eng, 1, seed=3)
    third = full_state(eng)
    eng.save_checkpoint(save_dir, tag="run/a")
    assert ce.last_step == 3 and "run/a" not in repo.names("deepspeed")
    slashed = engine(deepspeed, 2, seed=7)
    cds.attach(slashed, url)
    path, _ = slashed.load_checkpoint(save_dir, tag="run/a")
    assert path is not None
    compare(full_state(slashed), third, f"rank {rank}: tag with a slash")
    # A step saved before names existed: no name, no stubs -> the tag's integer and the step's metadata.
    dist.barrier()
    if rank == 0:
        assert repo.drop_name("deepspeed", "global_step1")
    dist.barrier()
    old = engine(deepspeed, 2, seed=6)
    cds.attach(old, url)
    path, _ = old.load_checkpoint(os.path.join(tmp, "before_names"), tag="global_step1")
    assert path is not None
    compare(full_state(old), first, f"rank {rank}: unnamed step by the old rules")
    repo.close()
    shutdown()
