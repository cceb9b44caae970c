/* A stand-in libcuda.so.1 for `python -m bench.launch --stub --bindings` on a machine without a
 * GPU: every driver entry point returns CUDA_SUCCESS at once and does nothing, so cuda-bindings'
 * own wrappers (their argument conversion) run as they do over the real driver. Only the entry
 * points the bindings resolve first are real symbols; the rest come from cuGetProcAddress. */
#include <string.h>

typedef int CUresult;

static CUresult success(void) { return 0; }  /* any driver call: returns at once */

CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags, int *status) {
    (void)version; (void)flags;
    *fn = strcmp(symbol, "cuDriverGetVersion") == 0 ? (void *)cuDriverGetVersion : (void *)success;
    if (status) *status = 0;
    return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, fn, version, flags, 0);
}

CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
