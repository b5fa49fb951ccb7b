"""Op-level speed/memory benchmark of every registered attention (the Combiner paper's Fig. 3).

``python -m longseq.bench`` (``make bench``), configured by ``conf/bench.yaml``:

    python -m longseq.bench                                   # every registered attention, L = 2^10..2^14
    python -m longseq.bench preset=quick                      # ~1-2 min on 2 CPU cores
    python -m longseq.bench attentions=[full,fixed,combiner_fixed] lengths=[1024,4096,16384] device=cuda

Writes ``logs/bench/<timestamp>/`` with results.csv, plot.png, env.json, results.md (and throughput.csv
when ``throughput=true``). Method: ``longseq.bench.cell`` (timing, peak memory) and
``longseq.bench.throughput`` (training tokens/s, Lightning overhead).
"""

from longseq.bench.run import run_benchmark
from longseq.bench.specs import build_spec, quick_names, registered_names, select_attentions

__all__ = ["build_spec", "quick_names", "registered_names", "run_benchmark", "select_attentions"]
