"""`tl.report.doctor()`: what is installed and registered, without importing a framework."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass, field
from importlib import metadata

from torchlens.report.scorecard import capability_row, scorecard_row


@dataclass(frozen=True)
class DoctorRow:
    key: str
    label: str
    status: str
    detail: str
    suggestion: str = ""


@dataclass
class DoctorReport:
    rows: list[DoctorRow] = field(default_factory=list)

    def __getitem__(self, key: str) -> DoctorRow:
        for r in self.rows:
            if r.key == key:
                return r
        raise KeyError(key)

    def keys(self) -> list[str]:
        return [r.key for r in self.rows]

    def table(self) -> str:
        w_key = max(len(r.key) for r in self.rows)
        w_status = max(len(r.status) for r in self.rows)
        lines = [f"{'key'.ljust(w_key)}  {'status'.ljust(w_status)}  detail", "-" * (w_key + w_status + 40)]
        for r in self.rows:
            tail = f"  ({r.suggestion})" if r.suggestion else ""
            lines.append(f"{r.key.ljust(w_key)}  {r.status.ljust(w_status)}  {r.detail}{tail}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def doctor() -> DoctorReport:
    """Every plugin (entry-point name, distribution, version; a broken or blocked one named
    with why), every registered backend (maturity, installed framework version, supported
    range, pin), its scorecard row and its capability coverage. Reads metadata and shipped
    records only; never raises for a faulty plugin."""
    from torchlens import __version__
    from torchlens.backends.registry import install_hint
    from torchlens.errors import PluginError
    from torchlens.plugins.manager import DISABLE_ENV, get_plugin_manager

    pm = get_plugin_manager()
    pm.load()
    rows = [DoctorRow("torchlens", "torchlens core", "ok",
                      f"torchlens-core {_version('torchlens-core') or __version__}, python {platform.python_version()}, "
                      f"{sys.platform}")]
    try:
        specs = pm.backends()  # before the plugin rows: a plugin whose hook fails is marked broken here
    except PluginError as exc:  # two plugins register one backend name: say so, list the rest
        specs = {}
        rows.append(DoctorRow("plugins", "plugin registry", "error", exc.message, exc.remedy))
    for p in pm.plugins:
        suggestion = {"broken": f"fix or uninstall {p.distribution}, or set {DISABLE_ENV}={p.name}",
                      "blocked": f"listed in {DISABLE_ENV} (or blocked by the application)"}.get(p.status, "")
        rows.append(DoctorRow(f"plugin:{p.name}", f"plugin {p.name}", p.status,
                              f"{p.group} = {p.value}; distribution {p.distribution} {p.version}"
                              + (f"; {p.error}" if p.error else ""), suggestion))
    for name, spec in specs.items():
        fw = spec.framework
        installed = fw.installed_version()
        in_range = installed is not None and fw.contains(installed)
        status = "ok" if in_range else ("absent" if installed is None else "out_of_range")
        rows.append(DoctorRow(f"backend:{name}", f"{name} backend", status,
                              f"{spec.maturity}; framework {'/'.join(fw.distributions)} {installed or 'absent'}, "
                              f"supported {fw.range_text()}, pinned {fw.pinned}",
                              "" if in_range else install_hint(fw.extra or name)))
    for name, spec in specs.items():
        for r in (scorecard_row(spec), capability_row(spec)):
            rows.append(DoctorRow(r["key"], r["label"], r["status"], r["detail"], r["suggestion"]))
    return DoctorReport(rows)
