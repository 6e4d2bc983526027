"""The example distribution's recipe is found through the `torchlens.recipes` entry point
alone, and only on first facet use (never at `import torchlens`, nor at capture). Each
check runs in a fresh interpreter so no earlier import can hide a premature load."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_torchlens_loads_no_recipe_module():
    out = _run("""
        import sys
        import torchlens
        loaded = sorted(m for m in sys.modules if m.startswith("torchlens_recipes_example") or m == "torchlens.facets"
                        or m.startswith("torchlens_torch.recipes"))
        print(loaded)
    """)
    assert out.strip() == "[]"


def test_entry_point_recipe_is_loaded_on_first_facet_use_and_reads_right_values():
    out = _run("""
        import sys
        import numpy as np
        import torchlens as tl
        from torchlens_reference import nn

        model = nn.LoopNet(width=4, steps=2)
        x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
        log = tl.trace(model, x)
        print("after capture:", "torchlens_recipes_example.recipes" in sys.modules)
        f = log.modules["self"].facets
        print("after view:", "torchlens_recipes_example.recipes" in sys.modules)  # views are lazy too
        f.keys()
        print("after facets:", "torchlens_recipes_example.recipes" in sys.modules)
        entry = x @ model.inp.weight.value.T + model.inp.bias.value
        assert np.array_equal(f["entry_lo"].value, entry[:, :2])
        assert np.array_equal(f.entry_hi.value, entry[:, 2:])
        assert np.array_equal(f["entry_w"].value, model.inp.weight.value)
        assert f["entry_lo"].capability == "selection"
        rows = [r for r in tl.facets.functions() if r["recipe_id"] == "recipes_example.loopnet_entry"]
        print("source:", rows[0]["source"], rows[0]["tier"])
    """)
    assert "after capture: False" in out and "after view: False" in out
    assert "after facets: True" in out
    assert "source: plugin class_name" in out


def test_user_recipe_beats_the_plugin_recipe_in_its_tier():
    out = _run("""
        import numpy as np
        import torchlens as tl
        from torchlens_reference import nn

        @tl.facets.register(class_name="LoopNet", recipe_id="mine")
        def mine(module):
            return {"entry_w": tl.facets.parameter_spec(module, "cell.weight", "mine")}

        model = nn.LoopNet(width=4, steps=2)
        log = tl.trace(model, np.ones((1, 4), dtype=np.float32))
        tl.facets.stamp(log)
        f = log.modules["self"].facets
        assert np.array_equal(f["entry_w"].value, model.cell.weight.value)  # the user recipe won
        assert "entry_lo" in f  # the plugin's other facets remain
        print("ok")
    """)
    assert out.strip() == "ok"
