"""The spec's `torchlens._semantic` home of the logit lens: an alias of `torchlens.lens`."""

from torchlens.lens import LensEntry, LensResult, head_projection, logit_lens, logit_lens_predictions, model_identity

__all__ = ["logit_lens", "logit_lens_predictions", "head_projection", "model_identity", "LensResult", "LensEntry"]
