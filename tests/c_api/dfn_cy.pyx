# cython: language_level=3
# A small Cython extension on dflash-native's C API through the package's declarations
# (dflash_native/__init__.pxd and dflash_native/dflash_native.pxd); tests/test_c_api.py builds it.
from libc.stdint cimport int32_t
from libc.stdlib cimport free, malloc

from dflash_native cimport dfn_engine, dfn_engine_create, dfn_engine_destroy, dfn_engine_options_default
from dflash_native cimport dflash_native as dfn


cdef int _stop_after(int32_t token, void * user) noexcept nogil:
    cdef int * left = <int *> user
    left[0] -= 1
    return left[0] <= 0


def generate(str target, drafter, str prompt, int max_tokens, double temperature=0.0, unsigned long long seed=0,
             int stop_after=0):
    """(prompt ids, generated ids, stop_reason) through the C API."""
    cdef dfn.dfn_engine_options o = dfn_engine_options_default()
    o.n_ctx = 1024
    o.n_threads = 2
    cdef dfn_engine * e = NULL
    t = target.encode()
    d = drafter.encode() if drafter is not None else None
    cdef dfn.dfn_status s = dfn_engine_create(t, <const char *> d if d is not None else NULL, &o, &e)
    if s != dfn.DFN_OK:
        raise RuntimeError(f"{dfn.dfn_status_name(s).decode()}: {dfn.dfn_last_error().decode()}")
    cdef int32_t ids[4096]
    cdef size_t n = 0
    cdef int32_t * out = <int32_t *> malloc((max_tokens + 1) * sizeof(int32_t))
    cdef size_t n_out = 0
    cdef dfn.dfn_generate_params g = dfn.dfn_generate_params_default()
    cdef int left = stop_after
    cdef dfn.dfn_stats st
    cdef dfn.dfn_token_callback cb = _stop_after if stop_after > 0 else <dfn.dfn_token_callback> NULL
    try:
        p = prompt.encode()
        s = dfn.dfn_tokenize(e, p, len(p), ids, 4096, &n)
        if s != dfn.DFN_OK:
            raise RuntimeError(dfn.dfn_last_error().decode())
        g.temperature = temperature
        g.seed = seed
        with nogil:
            s = dfn.dfn_generate(e, ids, n, &g, out, max_tokens, cb, &left, &n_out)
        if s != dfn.DFN_OK:
            raise RuntimeError(dfn.dfn_last_error().decode())
        st.struct_size = sizeof(dfn.dfn_stats)
        dfn.dfn_engine_last_stats(e, &st)
        return [ids[i] for i in range(n)], [out[i] for i in range(n_out)], st.stop_reason
    finally:
        free(out)
        dfn_engine_destroy(e)


def create_error(str target, int block_size):
    """(status name, message) of dfn_engine_create(target) with a drafter-less block_size option."""
    cdef dfn.dfn_engine_options o = dfn_engine_options_default()
    o.block_size = block_size
    cdef dfn_engine * e = NULL
    t = target.encode()
    cdef dfn.dfn_status s = dfn_engine_create(t, NULL, &o, &e)
    dfn_engine_destroy(e)
    return dfn.dfn_status_name(s).decode(), dfn.dfn_last_error().decode()


def version():
    return dfn.dfn_version().decode(), dfn.DFN_VERSION_STRING.decode()
