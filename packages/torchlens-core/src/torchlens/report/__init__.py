"""Reports: the doctor and scorecard reading (no framework is imported)."""

from torchlens.report.doctor import DoctorReport, DoctorRow, doctor
from torchlens.report.scorecard import capability_row, coverage_text, read_scorecard, scorecard_path, scorecard_row

__all__ = ["doctor", "DoctorReport", "DoctorRow", "read_scorecard", "scorecard_path", "scorecard_row", "capability_row", "coverage_text"]
