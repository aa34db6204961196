"""The pipeline (docs/design.md, "Data flow = module layout"), one folder per stage of the data flow:

    search/ -> trial/ -> measure/ -> decide/ -> records/, composed by study/

with the inputs beside them (`workloads/`, the typed `config`) and the command lines at the top (`tune`, `compare`,
`promote`). `pipeline/` stands on `serve/` (engines, the replica, the production endpoint) and never imports torch
or an engine's implementation."""
