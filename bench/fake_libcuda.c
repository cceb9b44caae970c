/* A stand-in libcuda.so.1 for machines without a GPU: every driver entry point returns
 * CUDA_SUCCESS at once and does nothing, so cuda-bindings' own wrappers (their argument
 * conversion) run as they do over the real driver. `python -m bench.launch --stub --bindings`
 * times launches through it; tests/test_bindings_launch.py reads back what each launch handed the
 * driver (`fake_last_launch`). Only the entry points the bindings resolve first are real symbols;
 * the rest come from cuGetProcAddress. No cuInit symbol: NVRTC, finding one in the process, would
 * also want the driver's cuGetExportTable. */
#include <stdint.h>
#include <string.h>

typedef int CUresult;

/* The last cuLaunchKernel or cuLaunchKernelEx, as the driver received it. */
struct fake_launch {
    uint64_t count;          /* launches so far */
    uint32_t ex;             /* 1: cuLaunchKernelEx */
    uint32_t grid[3], block[3], shared;
    uint64_t function, stream;
    uint64_t args[8];        /* the first arguments' values, fake_arg_sizes[i] bytes each */
    uint32_t num_attrs, attr_id, attr_value;  /* cuLaunchKernelEx: its first launch attribute */
};
struct fake_launch fake_last_launch;
uint32_t fake_arg_sizes[8];  /* set by the caller: the bytes (<= 8) of each argument to copy */

typedef struct {             /* CUlaunchAttribute: id, padding, a 64-byte value union */
    uint32_t id, pad;
    uint32_t value[16];
} fake_attribute;

typedef struct {             /* CUlaunchConfig */
    uint32_t grid[3], block[3], shared;
    uint64_t stream;
    fake_attribute *attrs;
    uint32_t num_attrs;
} fake_config;

static CUresult success(void) { return 0; }  /* any other driver call: returns at once */

static void record(uint64_t function, uint64_t stream, void **params) {
    fake_last_launch.count += 1;
    fake_last_launch.function = function;
    fake_last_launch.stream = stream;
    for (uint32_t i = 0; i < 8; ++i) {
        fake_last_launch.args[i] = 0;
        if (fake_arg_sizes[i]) memcpy(&fake_last_launch.args[i], params[i], fake_arg_sizes[i] > 8 ? 8 : fake_arg_sizes[i]);
    }
}

static CUresult launch_kernel(void *f, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by,
                              uint32_t bz, uint32_t shared, void *stream, void **params, void **extra) {
    (void)extra;
    const uint32_t dims[7] = {gx, gy, gz, bx, by, bz, shared};
    memcpy(fake_last_launch.grid, dims, sizeof(dims));
    fake_last_launch.ex = 0;
    fake_last_launch.num_attrs = fake_last_launch.attr_id = fake_last_launch.attr_value = 0;
    record((uint64_t)f, (uint64_t)stream, params);
    return 0;
}

static CUresult launch_kernel_ex(const fake_config *config, void *f, void **params, void **extra) {
    (void)extra;
    memcpy(fake_last_launch.grid, config->grid, 7 * sizeof(uint32_t));
    fake_last_launch.ex = 1;
    fake_last_launch.num_attrs = config->num_attrs;
    fake_last_launch.attr_id = config->num_attrs ? config->attrs[0].id : 0;
    fake_last_launch.attr_value = config->num_attrs ? config->attrs[0].value[0] : 0;
    record((uint64_t)f, config->stream, params);
    return 0;
}

CUresult cuDriverGetVersion(int *version) { *version = 13000; return 0; }

CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version, unsigned long long flags, int *status) {
    (void)version; (void)flags;
    if (strcmp(symbol, "cuDriverGetVersion") == 0) *fn = (void *)cuDriverGetVersion;
    else if (strcmp(symbol, "cuLaunchKernel") == 0) *fn = (void *)launch_kernel;
    else if (strcmp(symbol, "cuLaunchKernelEx") == 0) *fn = (void *)launch_kernel_ex;
    else *fn = (void *)success;
    if (status) *status = 0;
    return 0;
}

CUresult cuGetProcAddress(const char *symbol, void **fn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, fn, version, flags, 0);
}
