"""pyllama: an LLM inference server for GGUF models, built for layer splits over several machines."""
import os as _os

# Idle worker threads of the libraries under the kernels must sleep, not spin: the kernel pool
# runs on every core (-t), and a spinning worker takes a core from the ops that follow. Both
# libraries read their variable once, when they load, so they are set here, before anything of
# pyllama imports numpy or a kernel; a value the user set is kept.
# - OpenMP (a few loops in the kernels): spinning after a region stole the cores BLAS's threads
#   needed next (a 2-core decode step slowed 10x).
# - OpenBLAS (numpy's BLAS; the F32 prompt products) busy-waits about 0.1 s after every product:
#   a 512-token F32 prompt's attention then ran no faster on 2 threads than on 1.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
