"""Peak extra memory of direct_logit_contributions: independent of the vocabulary size.

    python benchmarks/mechinterp_dla_memory.py [--tokens 4] [--d-model 16] [--seq 8]

Builds a 1-layer GPT-2 (tiny d_model, random weights) twice, with vocab 50,000 and 200,000,
traces one prompt, then measures the peak bytes of the tensors ALLOCATED during one
`direct_logit_contributions(trace, answer=<4 tokens>)` call (a TorchDispatchMode counts every
op output's storage while it is alive: torch CPU memory accounting, the trace's own captured
payloads excluded). Target (issue 16): the two peaks within 10% of each other, because the kit
gathers only the requested tokens' unembedding rows (directions first), never the vocabulary.
Exits 1 when the ratio is outside [0.9, 1.1].
"""

from __future__ import annotations

import argparse
import sys
import weakref


class PeakTensorBytes:
    """Counts the storage bytes of tensors produced inside the block while they live."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t) -> None:
        import torch

        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self._seen or key == 0:
            return
        n = st.nbytes()
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)

        def free(key=key, n=n):
            self._seen.discard(key)
            self.live -= n

        weakref.finalize(t, free)

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    tracker._track(t)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


def measure(vocab: int, tokens: int, d_model: int, seq: int) -> tuple[int, float]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import torchlens as tl

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=d_model, n_head=2, vocab_size=vocab, n_positions=64,
                                       bos_token_id=0, eos_token_id=0, attn_implementation="eager")).eval()
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    trace = tl.trace(model, ids)
    answer = [int(vocab * f) for f in (0.1, 0.3, 0.6, 0.9)][:tokens]
    tl.mechinterp.direct_logit_contributions(trace, answer=answer)  # warm caches (facet entries)
    with PeakTensorBytes() as mem:
        res = tl.mechinterp.direct_logit_contributions(trace, answer=answer)
    return mem.peak, res.identity_receipt["max_budget_fraction"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=16)
    ap.add_argument("--seq", type=int, default=8)
    a = ap.parse_args()
    small, f1 = measure(50_000, a.tokens, a.d_model, a.seq)
    large, f2 = measure(200_000, a.tokens, a.d_model, a.seq)
    ratio = large / small
    print(f"peak extra bytes, {a.tokens} answer tokens: vocab 50,000 -> {small:,} B; vocab 200,000 -> {large:,} B")
    print(f"ratio 200k / 50k = {ratio:.4f} (target within [0.9, 1.1]); identity max_budget_fraction "
          f"{f1:.3g} / {f2:.3g}")
    print(f"for scale: one float32 logits row of the 200k vocabulary is {200_000 * 4:,} B")
    sys.exit(0 if 0.9 <= ratio <= 1.1 else 1)


if __name__ == "__main__":
    main()
