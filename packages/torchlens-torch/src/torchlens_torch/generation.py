"""The torch generation driver behind `tl.record(model, ids, save=..., generate_kwargs={...})` (issue 22).

It runs the model's own Hugging Face `generate()` once, with its KV cache, and observes every
forward `generate()` runs with forward hooks: a pre-hook on the root module reads the
forward's absolute positions (the cache length before it, plus its new tokens), a hook on
each selected module keeps that module's output (for a decode step: only the new position,
since the cache holds the rest), and the root's post-hook cuts the new KV-cache slices when
`kv_sites=` asks and hands everything to core (`request.on_forward`). Core applies
reducers, eviction and the byte budget (`torchlens.recording.generation`).

The hooks observe: they change no value, so the tokens equal those of `generate()` run
alone with the same seed. A module returning a tuple records its first tensor (the hidden
states of a transformer block).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from torchlens.backends.sdk import InvalidArgumentError, RecordingError

#: The generation settings that decide the tokens (read from the effective generation config).
_TOKEN_SETTINGS = ("max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                   "typical_p", "repetition_penalty", "no_repeat_ngram_size", "num_beams", "num_return_sequences",
                   "eos_token_id", "pad_token_id", "use_cache")


def _unsupported(reason: str, message: str, remedy: str) -> RecordingError:
    return RecordingError("record_generation_unsupported", message, remedy=remedy, reason=reason)


def _first_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    first = getattr(value, "to_tuple", None)
    if callable(first):
        return _first_tensor(first())
    return None


def _cache_of(kwargs: dict) -> Any:
    for name in ("cache", "past_key_values"):
        c = kwargs.get(name)
        if c is not None:
            return c
    return None


def _cache_length(cache: Any) -> int | None:
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        try:
            return int(get())
        except Exception:
            return None
    return None


def _layer_kv(cache: Any, index: int) -> tuple[Any, Any] | None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if index >= len(layers):
            return None
        layer = layers[index]
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            return keys, values
        return None
    kc, vc = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if kc is not None and vc is not None and index < len(kc):
        return kc[index], vc[index]
    return None


def _num_cache_layers(cache: Any) -> int:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return len(layers)
    kc = getattr(cache, "key_cache", None)
    return len(kc) if kc is not None else 0


class TorchGenerationDriver:
    """`SupportsGenerationRecording.generation_driver()` of the torch backend."""

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def concat(self, parts: list) -> Any:
        return torch.cat(list(parts), dim=0)

    def spill_save(self, obj: Any, path: str) -> None:
        torch.save(obj, path)

    def spill_load(self, path: str) -> Any:
        return torch.load(path, weights_only=True)

    def record_generation(self, model: Any, args: tuple, kwargs: dict, request: Any) -> Any:
        from torchlens.backends.sdk import ForwardData, GenerationRun

        root = model if isinstance(model, nn.Module) else getattr(model, "__self__", None)
        if not isinstance(root, nn.Module) or not callable(getattr(root, "generate", None)):
            raise _unsupported("no_generate", f"{type(model).__name__} has no Hugging Face generate()",
                               "pass a model with a generate() method (a transformers *ForCausalLM)")
        config = getattr(root, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            raise _unsupported("encoder_decoder", "encoder-decoder models", "record a decoder-only model")
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise _unsupported("inputs", "generation recording needs input_ids of shape [1, prompt_length]",
                               "tl.record(model, input_ids, generate_kwargs={...})")
        if ids.shape[0] != 1:
            raise _unsupported("batched_prompts", f"batched prompts (batch size {ids.shape[0]})", "record one prompt at a time")
        gen_config = getattr(root, "generation_config", None)
        gk = request.generate_kwargs

        def effective(name: str) -> Any:
            return gk[name] if name in gk else getattr(gen_config, name, None)

        if (effective("num_beams") or 1) > 1:
            raise _unsupported("beam_search", "beam search (num_beams > 1)", "use greedy or sampling decoding")
        if (effective("num_return_sequences") or 1) > 1:
            raise _unsupported("num_return_sequences", "more than one return sequence", "num_return_sequences=1")
        if effective("use_cache") is False or getattr(config, "use_cache", True) is False:
            raise _unsupported("use_cache_false", "use_cache=False (each decode step would rerun the whole prefix)",
                               "drop use_cache=False")
        modules = dict(root.named_modules())
        missing = [s for s in request.sites if s not in modules]
        if missing:
            raise InvalidArgumentError("save_spec_invalid", f"save= names no module {missing[0]!r} of this model",
                                       remedy="check [name for name, _ in model.named_modules()]", item=missing[0])
        kv_layers = request.kv_layers
        prompt_length = int(ids.shape[1])
        state = _ForwardState(request, prompt_length)
        handles = [root.register_forward_pre_hook(state.pre, with_kwargs=True),
                   root.register_forward_hook(state.post, with_kwargs=True)]
        for site in request.sites:
            handles.append(modules[site].register_forward_hook(state.site_hook(site)))
        state.kv_layers = kv_layers
        state.ForwardData = ForwardData
        if request.seed is not None:
            torch.manual_seed(request.seed)
        rng_digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
        wrapped = request.capture_forward is not None
        if wrapped:  # an op-level save=: every forward generate() runs goes through tl.trace's capture
            had_own = "forward" in root.__dict__
            own = root.__dict__.get("forward")
            root.forward = state.capturing_forward(root, request.capture_forward)
        try:
            output = root.generate(*args, **kwargs, **gk)
        finally:
            for h in handles:
                h.remove()
            if wrapped:
                if had_own:
                    root.forward = own
                else:
                    del root.forward
        if state.error is not None:  # an error a hook raised that generate() swallowed
            raise state.error
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", output)
        settings = {name: effective(name) for name in _TOKEN_SETTINGS}
        settings.update(seed=request.seed, rng_state_digest=rng_digest)
        return GenerationRun(output=output, sequences=sequences, prompt_length=prompt_length, settings=settings)


class _ForwardState:
    """The hooks' shared state for one generate() call."""

    def __init__(self, request: Any, prompt_length: int) -> None:
        self.request = request
        self.prompt_length = prompt_length
        self.current: Any = None
        self.depth = 0
        self.kv_layers: Any = None
        self.ForwardData: Any = None
        self.error: BaseException | None = None
        self.forwards = 0
        self.last_trace: Any = None
        self.cache: Any = None
        self.detach = request.detach

    def capturing_forward(self, root: nn.Module, capture_forward: Any) -> Any:
        """The instance `forward` generate() calls: the outer call runs the capture, whose own
        call of the root (depth already 1) reaches the class's forward."""
        original = type(root).forward
        inside = [False]

        def forward(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                return original(root, *args, **kwargs)
            inside[0] = True
            try:
                trace = capture_forward(root, args, kwargs)
            finally:
                inside[0] = False
            self.last_trace = trace
            return trace.output

        return forward

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        n = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0
        cache = _cache_of(kwargs)
        past = _cache_length(cache) if cache is not None else None
        if past is None:
            pos = kwargs.get("position_ids")
            past = int(pos.reshape(-1)[0]) if isinstance(pos, torch.Tensor) and pos.numel() else 0
        if cache is None and self.forwards > 0:
            self.error = _unsupported("no_cache", "generate() ran a decode step without a cache", "use_cache=True")
            raise self.error
        self.forwards += 1
        self.current = self.ForwardData(positions=range(past, past + n))
        self.cache = cache
        self.seen: set = set()
        self.dups: list = []

    def site_hook(self, site: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.current is None:  # outside a forward generate() runs
                return
            value = _first_tensor(output)
            if value is None:
                return
            if site in self.current.values:
                self.dups.append(site)
                return
            self.current.values[site] = value.detach() if self.detach else value
        return hook

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.depth -= 1
        if self.depth > 0:
            return
        data = self.current
        n = len(data.positions)
        if self.kv_layers is not None:
            cache = self.cache if self.cache is not None else getattr(output, "past_key_values", None)
            if cache is None:
                raise RecordingError("record_generation_reducer_invalid", "kv_sites=: the forward returned no KV cache",
                                     remedy="drop kv_sites= for this model")
            layers = range(_num_cache_layers(cache)) if self.kv_layers is True else sorted(self.kv_layers)
            for i in layers:
                kv = _layer_kv(cache, i)
                if kv is None:
                    raise RecordingError("record_generation_reducer_invalid", f"kv_sites=: the cache has no layer {i}",
                                         remedy=f"layers 0..{_num_cache_layers(cache) - 1}", layer=i)
                for name, t in zip(("key", "value"), kv):
                    # [batch, kv_heads, seq, head_dim] -> the new positions as [positions, kv_heads, head_dim]
                    data.kv[f"kv.{i}.{name}"] = t[0, :, -n:, :].detach().permute(1, 0, 2).clone()
        if self.dups:
            data.duplicates = tuple(dict.fromkeys(self.dups))
        if self.last_trace is not None:
            data.trace, self.last_trace = self.last_trace, None
            data.n_ops = len(data.trace.ops)
        self.current = None
        self.request.on_forward(data)
        self.cache = None


__all__ = ["TorchGenerationDriver"]
