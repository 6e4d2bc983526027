"""Subprocess entry points for the extraction tests: a disk run to be killed, and the
two-rank gloo run. Run as `python extract_worker.py MODE OUTDIR [...]`."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import torchlens as tl  # noqa: E402
from extract_models import token_data, token_model  # noqa: E402

LAYERS = ["fc1", "act"]


def disk_run(out: str, delay: float) -> None:
    tl.extract_dataset(token_model(delay=delay), token_data(), LAYERS, batch_size=8, path=out, progress=False)


def metrics() -> dict:
    return {"fc1": tl.stats.Covariance(), "act": tl.stats.Mean(), ("fc1", "act"): tl.stats.CKA(),
            "fc2": tl.stats.TopK(3, unit_axis=-1), tl.grad("fc1"): tl.stats.Mean()}


def loader() -> list:
    x = token_data(n=45)
    return [x[i:i + 4] for i in range(0, 45, 4)]  # 12 batches, the last short: uneven over 2 ranks


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def rank_main(rank: int, world: int, out: str, init: str) -> None:
    import torch.distributed as dist

    # no `import torchlens_torch.distributed_data`: the torch plugin finds the group by itself
    if init == "env://":  # launched by torchrun: rank, world size and rendezvous come from the environment
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        res = tl.stats.aggregate(token_model(), loader(), metrics(), loss_fn=loss_fn)
        for key, acc in res.items():
            safe = "".join(c if c.isalnum() else "_" for c in key)
            tl.stats.save_fitted(acc, os.path.join(out, f"r{rank}_{safe}.safetensors"))
        tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=8, path=os.path.join(out, "ext"),
                           store_input_ids=True, progress=False)
        mem = tl.extract_dataset(token_model(), token_data(), LAYERS, batch_size=8)
        np.save(os.path.join(out, f"r{rank}_mem_fc1.npy"), mem["fc1"])
        with open(os.path.join(out, f"r{rank}_done.json"), "w") as f:
            json.dump({"rank": dist.get_rank(), "world": dist.get_world_size()}, f)
        # Every rank arrives before any tears its gloo pairs down: a rank that destroys the group
        # while its peer still holds the pair open can abort in gloo's teardown
        # ("terminate called without an active exception"), after all the work is done.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every output is written and every rank has passed the barrier. gloo's C++ teardown can still
    # abort a rank ("terminate called without an active exception", exit -6; about 1 run in 10
    # on a loaded 2-core machine, even after the barrier), so a finished rank leaves without
    # running it: the test checks the files, and the process exit code must not depend on
    # that race.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "disk":
        disk_run(sys.argv[2], float(sys.argv[3]))
    elif mode == "ranks":
        out, init = sys.argv[2], sys.argv[3]
        torch.multiprocessing.spawn(rank_main, args=(2, out, init), nprocs=2, join=True)
    elif mode == "torchrun":  # torchrun --nproc-per-node 2 ... extract_worker.py torchrun OUTDIR
        rank_main(-1, -1, sys.argv[2], "env://")
