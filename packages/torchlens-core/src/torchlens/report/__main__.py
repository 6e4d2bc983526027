"""`python -m torchlens.report --write-docs [PATH] | --check-docs [PATH]`: the capability
table of docs/backends.md, from the shipped scorecard records."""

from torchlens.report.scorecard import main

raise SystemExit(main())
