# cython: language_level=3
# A small Cython extension on dflash-native's C API through the package's declarations
# (dflash_native/__init__.pxd and dflash_native/dflash_native.pxd); tests/test_c_api.py builds it.
from libc.stdint cimport int32_t, uint32_t
from libc.stdlib cimport calloc, free, malloc

from dflash_native cimport dfn_engine, dfn_engine_create, dfn_engine_destroy, dfn_engine_options_default
from dflash_native cimport dflash_native as dfn


cdef int _stop_after(int32_t token, void * user) noexcept nogil:
    cdef int * left = <int *> user
    left[0] -= 1
    return left[0] <= 0


# A dfn_constraint: only tokens of a set, exactly k of them, then the end-of-generation token.
cdef struct _set_automaton:
    char * allowed  # [n_vocab]
    int32_t n_vocab, eos
    size_t k, used
    int terminated


cdef int _set_fill(void * user, uint32_t * mask, size_t n_words) noexcept nogil:
    cdef _set_automaton * a = <_set_automaton *> user
    cdef int32_t t
    if a.terminated:
        return 0
    if a.used == a.k:
        mask[a.eos >> 5] |= (<uint32_t> 1) << (a.eos & 31)
        return 0
    for t in range(a.n_vocab):
        if a.allowed[t]:
            mask[t >> 5] |= (<uint32_t> 1) << (t & 31)
    return 0


cdef int _set_accept(void * user, int32_t token) noexcept nogil:
    cdef _set_automaton * a = <_set_automaton *> user
    if a.terminated or token < 0 or token >= a.n_vocab:
        return 0
    if a.used == a.k:
        a.terminated = token == a.eos
        return a.terminated
    if not a.allowed[token]:
        return 0
    a.used += 1
    return 1


cdef int _set_rollback(void * user, size_t n) noexcept nogil:
    cdef _set_automaton * a = <_set_automaton *> user
    if a.terminated:
        a.terminated = 0
        n -= 1
    if n > a.used:
        return -1
    a.used -= n
    return 0


cdef int _set_terminated(void * user) noexcept nogil:
    return (<_set_automaton *> user).terminated


def generate(str target, drafter, str prompt, int max_tokens, double temperature=0.0, unsigned long long seed=0,
             int stop_after=0, allowed=None, size_t k=0):
    """(prompt ids, generated ids, stop_reason) through the C API; allowed (token ids): under the
    constraint "k tokens of allowed, then the end-of-generation token"."""
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
    cdef _set_automaton a
    cdef dfn.dfn_constraint c
    a.allowed = NULL
    try:
        if allowed is not None:
            a.n_vocab, a.eos, a.k, a.used, a.terminated = dfn.dfn_engine_n_vocab(e), dfn.dfn_engine_eos_token(e), k, 0, 0
            a.allowed = <char *> calloc(a.n_vocab, 1)
            for t in allowed:
                a.allowed[<int32_t> t] = 1
            c.struct_size, c.user_data = sizeof(dfn.dfn_constraint), &a
            c.fill_mask, c.accept, c.rollback, c.is_terminated = _set_fill, _set_accept, _set_rollback, _set_terminated
            g.constraint = &c
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
        free(a.allowed)
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
