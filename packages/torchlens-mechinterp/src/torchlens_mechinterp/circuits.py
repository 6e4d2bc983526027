"""QK and OV circuits as factored matrices (TransformerLens's ``model.QK`` / ``model.OV``
convention: ``QK[h] = W_Q[h] @ W_K[h].T`` and ``OV[h] = W_V[h] @ W_O[h]``, each
``[d_model, d_model]``; biases excluded; under grouped-query attention each query head pairs
with the K/V head that serves it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlens_mechinterp.heads import head_weight_views


@dataclass
class FactoredMatrix:
    """``A @ B`` kept factored: A ``[..., m, r]``, B ``[..., r, n]``. `AB` materialises it;
    `shape` is the product's shape; indexing a leading (head) axis returns a FactoredMatrix."""

    A: Any
    B: Any

    def __post_init__(self) -> None:
        if self.A.shape[-1] != self.B.shape[-2] or self.A.shape[:-2] != self.B.shape[:-2]:
            from torchlens.errors import InvalidArgumentError

            raise InvalidArgumentError("invalid_argument", f"FactoredMatrix factors do not chain: "
                                       f"{tuple(self.A.shape)} @ {tuple(self.B.shape)}",
                                       remedy="A is [..., m, r] and B [..., r, n] with equal leading axes")

    @property
    def AB(self) -> Any:
        return self.A @ self.B

    @property
    def BA(self) -> Any:
        return self.B @ self.A

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.A.shape[:-1]) + (self.B.shape[-1],)

    @property
    def T(self) -> "FactoredMatrix":
        return FactoredMatrix(self.B.transpose(-1, -2), self.A.transpose(-1, -2))

    @property
    def rdim(self) -> int:
        return int(self.A.shape[-1])

    def __getitem__(self, idx: Any) -> "FactoredMatrix":
        return FactoredMatrix(self.A[idx], self.B[idx])

    def __matmul__(self, other: Any) -> "FactoredMatrix":
        return FactoredMatrix(self.A, self.B @ other)

    def __rmatmul__(self, other: Any) -> "FactoredMatrix":
        return FactoredMatrix(other @ self.A, self.B)

    def svd(self) -> tuple[Any, Any, Any]:
        """(U, S, Vh) of the product, computed from the factors (rank <= rdim)."""
        import torch

        Ua, Sa, Vha = torch.linalg.svd(self.A, full_matrices=False)
        mid = (Sa.unsqueeze(-1) * Vha) @ self.B
        Um, Sm, Vhm = torch.linalg.svd(mid, full_matrices=False)
        return Ua @ Um, Sm, Vhm

    def eigenvalues(self) -> Any:
        """Non-zero eigenvalues of the product (those of B @ A, the small r x r matrix)."""
        import torch

        return torch.linalg.eigvals(self.BA)

    def norm(self) -> Any:
        """Frobenius norm of the product."""
        return self.svd()[1].pow(2).sum(-1).sqrt()

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={self.shape}, rdim={self.rdim})"


def _kv_index(views: Any) -> Any:
    import torch

    return torch.tensor([views.kv_head_of(h) for h in range(views.n_heads)])


def qk_circuit(trace: Any, attention: Any) -> FactoredMatrix:
    """``[num_q_heads, d_model, d_model]``: W_Q[h] @ W_K[kv(h)].T (biases excluded)."""
    v = head_weight_views(trace, attention)
    return FactoredMatrix(v.W_Q, v.W_K[_kv_index(v)].transpose(-1, -2))


def ov_circuit(trace: Any, attention: Any) -> FactoredMatrix:
    """``[num_q_heads, d_model, d_model]``: W_V[kv(h)] @ W_O[h] (biases excluded)."""
    v = head_weight_views(trace, attention)
    return FactoredMatrix(v.W_V[_kv_index(v)], v.W_O)


__all__ = ["FactoredMatrix", "qk_circuit", "ov_circuit"]
