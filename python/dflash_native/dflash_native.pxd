# cython: language_level=3
# Cython declarations of the C API (include/dflash_native.h), shipped in the package:
#
#     from dflash_native cimport dflash_native as dfn    # this file
#     cdef dfn.dfn_engine * e = NULL
#     dfn.dfn_engine_create(b"target.gguf", NULL, NULL, &e)
#
# Build with include_dirs=[dflash_native.get_include()], library_dirs=[dflash_native.get_library_dir()],
# libraries=["dflash_native"] and that directory as the runtime path (README: the Cython route).
# See the header for what each function does, its error codes and the ABI rules.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

cdef extern from "dflash_native.h" nogil:
    int DFN_VERSION_MAJOR
    int DFN_VERSION_MINOR
    int DFN_VERSION_PATCH
    const char * DFN_VERSION_STRING
    int DFN_VERSION_NUMBER
    int DFN_MAX_BLOCK_SIZE

    ctypedef enum dfn_status:
        DFN_OK
        DFN_ERR_INVALID_ARGUMENT
        DFN_ERR_FILE
        DFN_ERR_BUFFER_TOO_SMALL
        DFN_ERR_NO_VOCABULARY
        DFN_ERR_OUT_OF_MEMORY
        DFN_ERR_RUNTIME
        DFN_ERR_CONSTRAINT

    const char * dfn_last_error()
    const char * dfn_status_name(dfn_status status)
    const char * dfn_version()
    int dfn_version_number()

    ctypedef struct dfn_engine:
        pass

    ctypedef enum dfn_kv_type:
        DFN_KV_F16
        DFN_KV_F32
    ctypedef enum dfn_device:
        DFN_DEVICE_CPU
        DFN_DEVICE_GPU
    ctypedef enum dfn_verify:
        DFN_VERIFY_CHAIN
        DFN_VERIFY_TREE

    ctypedef struct dfn_engine_options:
        size_t struct_size
        int64_t n_ctx
        int32_t n_threads
        int32_t block_size
        int64_t n_batch
        int32_t kv_type
        int32_t device
        int32_t reserved0
        int32_t verify
        int32_t tree_budget
        int32_t gate
        int64_t feature_ring_capacity
        int64_t drafter_window
        double draft_cutoff
        int32_t draft_vocab
        int32_t use_mmap
        const char * device_name
        int32_t n_seq

    dfn_engine_options dfn_engine_options_default()
    dfn_status dfn_engine_create(const char * target_path, const char * drafter_path,
                                 const dfn_engine_options * options, dfn_engine ** out)
    dfn_status dfn_engine_destroy(dfn_engine * engine)
    int32_t dfn_engine_n_vocab(const dfn_engine * engine)
    int64_t dfn_engine_n_ctx(const dfn_engine * engine)
    int32_t dfn_engine_block_size(const dfn_engine * engine)
    int32_t dfn_engine_eos_token(const dfn_engine * engine)

    dfn_status dfn_tokenize(const dfn_engine * engine, const char * text, size_t n_text, int32_t * tokens,
                            size_t capacity, size_t * n_tokens)
    dfn_status dfn_detokenize(const dfn_engine * engine, const int32_t * tokens, size_t n_tokens, char * text,
                              size_t capacity, size_t * n_bytes)

    ctypedef struct dfn_constraint:
        size_t struct_size
        void * user_data
        int (*fill_mask)(void * user_data, uint32_t * mask, size_t n_words)
        int (*accept)(void * user_data, int32_t token)
        int (*rollback)(void * user_data, size_t n)
        int (*is_terminated)(void * user_data)

    ctypedef struct dfn_generate_params:
        size_t struct_size
        double temperature
        int32_t top_k
        double top_p
        double min_p
        uint64_t seed
        int32_t speculative
        const dfn_constraint * constraint

    dfn_generate_params dfn_generate_params_default()

    ctypedef int (*dfn_token_callback)(int32_t token, void * user_data)

    ctypedef enum dfn_stop_reason:
        DFN_STOP_NONE
        DFN_STOP_EOS
        DFN_STOP_LENGTH
        DFN_STOP_CONTEXT
        DFN_STOP_CALLBACK

    dfn_status dfn_generate(dfn_engine * engine, const int32_t * prompt, size_t n_prompt,
                            const dfn_generate_params * params, int32_t * out, size_t max_tokens,
                            dfn_token_callback callback, void * user_data, size_t * n_out)

    ctypedef struct dfn_stats:
        size_t struct_size
        int64_t n_prompt_tokens
        int64_t n_generated
        double prefill_s
        double decode_s
        int32_t stop_reason
        int32_t speculative
        int32_t block_size
        int64_t rounds
        int64_t ar_steps
        int64_t controller_switches
        int64_t verified_tokens
        double draft_s
        double verify_s
        double rollback_s
        int64_t acceptance_histogram[65]
        uint64_t seed
        int32_t drafter_failed

    const char * dfn_engine_drafter_failure(const dfn_engine * engine)
    dfn_status dfn_engine_last_stats(const dfn_engine * engine, dfn_stats * stats)
