"""The bad-input matrix (docs/BAD_INPUT.md): every public entry point against wrong dtype, shape,
length, range, null pointers, closed objects, ids >= vocab/rows and empty input.

Each case must raise a clear exception (its type, and key words of its message), write nothing
(device memory, pinned and host outputs, files and object state compared before and after; no
launch, no upload) and leave the entry point usable: a good call of it afterwards gives the right
answer. An "empty" case that is a no-op must return without writing anything either.

* CPU (CI): the layers, launchers and host entry points on ``LoggingBackend``, a host-memory
  backend that logs every write; ``CudaBackend``'s own checks on an *offline* ``CudaBackend`` whose
  driver calls all raise ``DriverReached``, so each refusal is shown to come before the driver.
* GPU: the same ``CudaBackend`` cases on the device (buffers of random bytes compared bit for bit)
  and one launcher per kernel module on guarded buffers, then a small round trip and a good launch
  of that launcher checked against numpy: the backend is still usable.

Known gaps are cases marked ``xfail(strict=True)``: the day one is fixed, the marker must go.
The page docs/BAD_INPUT.md is generated from the case tables:
``python -m tests.bad_inputs > docs/BAD_INPUT.md``.

Layout: ``matrix`` (rows, columns, the case constructors), ``world`` (the CPU subjects on a
logging host-memory backend), ``offline`` (the offline ``CudaBackend``), ``launcher_rows`` (each
launcher row's function and kernel), ``device`` (the GPU rigs), ``cases/`` (the tables by area:
runtime, launchers, n-gram weights, n-gram runners, loaders, row cache and table files, overlays,
Engram),
``readme`` (the generated page, docs/BAD_INPUT.md; the name is from when it was a README section);
the tests are ``test_cpu``, ``test_offline_cuda``, ``test_gpu_backend``, ``test_gpu_launchers`` and
``test_readme`` (the page against the cases).
"""
