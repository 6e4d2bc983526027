"""Extraction helpers at dataset scale (issue 23): `tl.pluck`, `tl.extract`,
`tl.extract_dataset` (memory and disk mode, resume, data-parallel groups), the readers, and
`tl.stats.aggregate`. Core only: values reach NumPy through the backend's host copy."""

from __future__ import annotations

from torchlens.dataset_extraction.aggregate import aggregate
from torchlens.dataset_extraction.dataset import extract_dataset
from torchlens.dataset_extraction.helpers import extract, pluck
from torchlens.dataset_extraction.parallel import DataParallelGroup, LocalGroup, register_group_provider
from torchlens.dataset_extraction.reader import ExtractionReader, LoadedExtraction, TokenRows, load_extraction
from torchlens.dataset_extraction.shards import is_extraction_dir

__all__ = ["pluck", "extract", "extract_dataset", "aggregate", "ExtractionReader", "LoadedExtraction", "TokenRows",
           "load_extraction", "is_extraction_dir", "DataParallelGroup", "LocalGroup", "register_group_provider"]
