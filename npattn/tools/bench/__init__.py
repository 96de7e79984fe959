"""``npattn bench``: how fast and how lean npattn is, against torch in the same run.

Sections (each runs alone: ``npattn bench --window`` measures only the window sweep; several flags
run several; no flag runs the timing table; ``--quick`` tiny sizes for smoke tests; ``--json``
the machine-readable report on stdout).  Every section prints its progress on stderr, one line
per step with an estimate of the time left (``[3/12] mha b=8 ... float32 ... ~40 s left``).

Where things are (read in this order):

* ``cli.py``      the command: ``SECTIONS`` (the list of sections and their flags), ``main``,
                  the plain-text report;
* ``timing.py``   the timing table: forward+backward of the main layers against torch; its cases
                  are data (``TABLE``, ``QUICK``);
* ``decode.py``   greedy decoding tokens/s with and without the KV cache, against torch;
* ``memory.py``   peak memory of both attention cores against sequence length;
* ``window.py``   windowed attention against sequence length (work linear in L);
* ``delta.py``    the chunked delta rule (gated DeltaNet) against its recurrence and transformers'
                  torch implementation, against sequence length;
* ``second_order.py`` a Hessian-vector product against forward+backward (MultiHeadAttention,
                  ``CausalLM.loss_hvp``), the memory-efficient core's second-order memory;
* ``decode_large.py`` decoding a Qwen3-0.6B-shaped model (float32 and bfloat16 storage) against
                  the GEMV bandwidth limit and transformers, prefill, the load's peak memory;
* ``cases.py``    what can be measured: each kind of case builds npattn's callables (and torch's,
                  same weights) from its sizes; FLOP counts;
* ``twins.py``    torch's side of each case (imported only when torch is; like any code that runs
                  only beside torch, e.g. a branch marked ``# pragma: needs torch``, it is not
                  counted by the coverage floor, so that the floor is the same with and without
                  torch);
* ``runner.py``   the one runner every section uses: timing in turns, npattn's side in a child
                  process without torch, fresh-process runs for seconds and peak memory, progress;
* ``machine.py``  what the numbers were measured on (CPU, BLAS, load, numpy's GEMM peak) and the
                  OpenBLAS environment probe;
* ``text.py``     aligned columns.

To add a case to a section: add a ``(kind, sizes)`` entry to its data (e.g. ``timing.TABLE``).
To add a kind of case: a function ``build(dtype, torch, **sizes) -> Built`` in ``cases.py`` (or
its own module) registered in ``cases.KINDS`` with its FLOP count, and its torch twin in
``twins.py``; ``runner.time_case`` times it in turns (npattn's side in a child process) and
``runner.fresh`` measures its memory in a fresh process.
To add a section: a module with ``collect(quick, progress) -> dict`` (its entries of the report,
built from ``runner.Step``s run by ``runner.run_steps``) and ``format_section(report) -> lines``,
and one ``Section`` entry in ``cli.SECTIONS`` (which also gives the ``--name`` flag).  Keep its
default size to about a minute.

Honest measurement, the rules every section keeps:

* npattn's side is timed in a process that never imports torch (``runner.Child``): torch's own
  threads and allocations in the same process change what numpy's calls cost.
* Both libraries take turns (``runner.time_interleaved``): a slow spell of a shared machine hits
  both alike; each turn starts after a pause and an untimed call, so neither library is timed on
  the other's leftovers (spinning threads, caches, freed memory).
* Ratios come only from one run on one machine; the report names the CPU, its SIMD flags, the BLAS
  numpy uses, torch's thread count, the load average and the idle fraction at the start.
* The user's environment is never changed: when ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` are set
  and measured to slow numpy's GEMM, the timing cases run again in a child process without them,
  reported as a labelled variant, never as the default (not with ``--quick`` or
  ``NPATTN_BENCH_KEEP_ENV=1``).  torch links its own BLAS and is not affected by these variables.
* Memory is measured in a fresh process per case: the peak resident size (``VmHWM``) minus the
  resident size just before the call (interpreter, numpy, npattn and the inputs loaded).
"""

from .cases import KINDS, Built, Kind, Missing, attention_flops, encoder_flops, mha_flops
from .cli import SECTIONS, format_table, main
from .decode import DECODE, DECODE_QUICK, bench_decode, format_decode
from .machine import gemm_peak, machine_info, probe_openblas_env
from .memory import IMPLS as MEMORY_IMPLS
from .memory import memory_one, memory_table, memory_torch
from .runner import Child, fresh, run_steps, time_case, time_interleaved
from .timing import row
from .window import format_window, window_one, window_table

__all__ = [
    "KINDS",
    "Built",
    "Kind",
    "Missing",
    "attention_flops",
    "encoder_flops",
    "mha_flops",
    "SECTIONS",
    "format_table",
    "main",
    "DECODE",
    "DECODE_QUICK",
    "bench_decode",
    "format_decode",
    "gemm_peak",
    "machine_info",
    "probe_openblas_env",
    "MEMORY_IMPLS",
    "memory_one",
    "memory_table",
    "memory_torch",
    "Child",
    "fresh",
    "run_steps",
    "time_case",
    "time_interleaved",
    "row",
    "format_window",
    "window_one",
    "window_table",
]
