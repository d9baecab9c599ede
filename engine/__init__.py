"""celeris.engine: models and decoding (no transport).

Imported before any matmul runs, it asks Intel MKL (torch's CPU BLAS on x86) for its strict
conditional numerical reproducibility mode, unless the environment already chose one: MKL then
rounds each row of a float32 GEMM the same whatever the matrix's row count and the thread count
(measured at 1-300 rows, 1 and 2 threads, 32-4,096 wide). Batch invariance on the CPU rests on
that (a request decodes the same tokens alone and in any batch; a prompt's keys are the same bits
in any chunk): without it, MKL
on an AVX-512 Intel host picks a different kernel below ~16 rows and splits some shapes by row
count across threads. MKL reads the variable once, at its first call, so it must be set before
any GEMM of the process: `celeris.engine.threads.gemm_rows_invariant()` says whether it took
(`celeris serve` warns at start-up when it did not).
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
