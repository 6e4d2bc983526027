"""Module-output edits by class patching (`sdk.attach_class_edits`) edit one module call once,
also when a subclass's `__call__` reaches a patched base `__call__` through `super()` (as Keras
layers do), while a module that calls itself still gets each of its calls edited."""

from __future__ import annotations

from torchlens.intervention.class_edits import attach_class_edits


class _Edit:
    trusted = True

    def __call__(self, value, ctx):
        return value + 100.0


def _edit_output(out, fn):
    return fn(out), 1


class Base:
    def __call__(self, x):
        return x * 2.0


class Sub(Base):
    def __call__(self, x):  # reaches Base.__call__ through super(), on the same object
        return super().__call__(x) + 1.0


class Recursive:
    def __call__(self, x, depth=2):
        return x if depth == 0 else self(x + 1.0, depth - 1)


def test_a_super_chain_is_edited_once_and_restored():
    sub = Sub()
    before = (Base.__dict__["__call__"], Sub.__dict__["__call__"])
    fired: dict = {}
    handle = attach_class_edits([("self", sub)], [("self", None, _Edit())], ops=None, fired=fired,
                                classes=[Sub, Base], edit_output=_edit_output)
    try:
        assert sub(1.0) == 1.0 * 2.0 + 1.0 + 100.0   # edited once, not twice
        assert fired == {0: 1}
    finally:
        handle.remove()
    assert (Base.__dict__["__call__"], Sub.__dict__["__call__"]) == before
    assert sub(1.0) == 3.0


def test_a_module_calling_itself_has_every_call_edited():
    rec = Recursive()
    fired: dict = {}
    handle = attach_class_edits([("self", rec)], [("self", None, _Edit())], ops=None, fired=fired,
                                classes=[Recursive], edit_output=_edit_output)
    try:
        # depth 2 -> 1 -> 0: three calls, each edited as it returns: ((1+2)+100)+100)+100
        assert rec(1.0) == 1.0 + 2.0 + 300.0
        assert fired == {0: 3}
    finally:
        handle.remove()
