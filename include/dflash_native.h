/* dflash-native C API: exact DFlash speculative decoding of GGUF models, for C programs and other
 * C-extension stacks (Cython: dflash_native/dflash_native.pxd). The Python package's _core is a
 * client of the same library (libdflash_native), so both run one core.
 *
 * Finding it: `python -c "import dflash_native; print(dflash_native.get_cmake_dir())"` into
 * CMAKE_PREFIX_PATH, then find_package(dflash_native CONFIG) and link dflash_native::dflash_native;
 * or dflash_native.get_include() / get_library_dir() for other build systems.
 *
 * ABI rules (within one DFN_VERSION_MAJOR):
 *   - Functions are only added, never removed or changed in signature.
 *   - Enum values keep their numbers; new values are appended.
 *   - Option and statistics structs start with `size_t struct_size`, set by the caller (the
 *     *_default() initializers set it to the size the caller was compiled with). New fields are
 *     only appended: the library reads (options) or writes (statistics) only the first
 *     struct_size bytes, and uses defaults for fields past them. A struct_size smaller than the
 *     first release's struct, or larger than the library knows, is DFN_ERR_INVALID_ARGUMENT.
 *   - Handles are opaque; their layout is not part of the ABI.
 *   - Nothing aborts, exits or throws across this API: every failure returns a dfn_status and
 *     leaves a message in dfn_last_error() (thread-local: the calling thread's last failure).
 *
 * Threads: different engines may run on different threads at once. An engine created with
 * n_seq = 1 (the default) runs one call at a time (calls on the same engine from several threads at
 * once must be serialised by the caller); a dfn_generate on an engine that is running one (from
 * another thread, or from its own token callback) returns DFN_ERR_INVALID_ARGUMENT and leaves the
 * running call alone.
 *   An engine created with n_seq > 1 (dfn_engine_options.n_seq) takes dfn_generate calls from any
 * number of threads at once, and from its token callbacks: each call is one request of the
 * engine's scheduler, which runs up to n_seq of them in the same steps (one target pass over all
 * of them; later calls wait for a free slot, in the order they came) and returns when the call's
 * own request ends. A call's tokens equal those of the same call alone on an n_seq = 1 engine,
 * bit for bit. The steps run on the calling threads (the library starts none): a call waiting for
 * tokens while no step runs runs the next step for all of them. A call's token callback runs on
 * its own thread, between steps (a slow callback delays only its own call); its non-zero return
 * ends that call's request alone (tokens the request made after that one are dropped). A call's
 * failure (a bad prompt, its sampling settings) is its own status and its thread's
 * dfn_last_error; the other calls go on. dfn_engine_last_stats is per thread on such an engine,
 * and dfn_engine_destroy refuses it (DFN_ERR_INVALID_ARGUMENT) while any call runs.
 *   An engine runs
 * only in the process that made it: in a fork() of it, dfn_generate returns DFN_ERR_RUNTIME; there,
 * once the parent's engines ran ggml's OpenMP pool, dfn_engine_create with n_threads != 1 returns
 * DFN_ERR_RUNTIME too (that pool cannot start again in a fork()).
 */
#ifndef DFLASH_NATIVE_H
#define DFLASH_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  if defined(DFN_BUILDING_LIBRARY)
#    define DFN_API __declspec(dllexport)
#  else
#    define DFN_API __declspec(dllimport)
#  endif
#else
#  define DFN_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The version this header belongs to; dfn_version() is the library's at run time. */
#define DFN_VERSION_MAJOR 0
#define DFN_VERSION_MINOR 1
#define DFN_VERSION_PATCH 0
#define DFN_VERSION_STRING "0.1.0"
/* MAJOR * 10000 + MINOR * 100 + PATCH, as dfn_version_number() returns it */
#define DFN_VERSION_NUMBER (DFN_VERSION_MAJOR * 10000 + DFN_VERSION_MINOR * 100 + DFN_VERSION_PATCH)

/* ---- errors ---------------------------------------------------------------------------------- */

typedef enum dfn_status {
    DFN_OK = 0,
    DFN_ERR_INVALID_ARGUMENT = 1,  /* a NULL where a pointer is needed, an option or value out of range,
                                      a token id outside the vocabulary, a prompt too long for n_ctx */
    DFN_ERR_FILE = 2,              /* a GGUF that cannot be opened, or is not a model this library runs
                                      (bad magic, missing tensors, unsupported architecture, broken vocabulary) */
    DFN_ERR_BUFFER_TOO_SMALL = 3,  /* the caller's buffer is too small: *n_needed says how much is needed */
    DFN_ERR_NO_VOCABULARY = 4,     /* text asked of a model whose GGUF has no tokenizer (token ids still work) */
    DFN_ERR_OUT_OF_MEMORY = 5,     /* memory ran out (the message names the buffer) */
    DFN_ERR_RUNTIME = 6,           /* any other failure while running (a backend, non-finite logits) */
    DFN_ERR_CONSTRAINT = 7         /* a callback of the caller's dfn_constraint returned an error */
} dfn_status;

/* The calling thread's last failure message ("" when none yet), valid until its next failing call.
 * Never NULL. Messages start with "[where]", e.g. "[dfn_engine_create] cannot open '...'". */
DFN_API const char * dfn_last_error(void);
/* A constant name for a status, e.g. "DFN_ERR_FILE". */
DFN_API const char * dfn_status_name(dfn_status status);

/* ---- version --------------------------------------------------------------------------------- */

DFN_API const char * dfn_version(void);  /* "MAJOR.MINOR.PATCH" of the library */
DFN_API int dfn_version_number(void);    /* as DFN_VERSION_NUMBER */

/* ---- engine ---------------------------------------------------------------------------------- */

typedef struct dfn_engine dfn_engine; /* opaque */

typedef enum dfn_kv_type { DFN_KV_F16 = 0, DFN_KV_F32 = 1 } dfn_kv_type;
typedef enum dfn_device { DFN_DEVICE_CPU = 0, DFN_DEVICE_GPU = 1 } dfn_device;
typedef enum dfn_verify { DFN_VERIFY_CHAIN = 0, DFN_VERIFY_TREE = 1 } dfn_verify;

/* The Engine's options (see dflash_native.Engine for what each does). */
typedef struct dfn_engine_options {
    size_t struct_size;            /* sizeof(dfn_engine_options) as the caller was compiled */
    int64_t n_ctx;                 /* context length in tokens (4096) */
    int32_t n_threads;             /* CPU threads, 0: every core (0) */
    int32_t block_size;            /* tokens verified per round, 2..64; 0: the drafter's trained block size (0) */
    int64_t n_batch;               /* tokens per prefill graph (512) */
    int32_t kv_type;               /* dfn_kv_type (DFN_KV_F16) */
    int32_t device;                /* dfn_device (DFN_DEVICE_CPU) */
    int32_t reserved0;             /* must be 0 (the field that chose a benchmark matmul in 0.1 builds) */
    int32_t verify;                /* dfn_verify (DFN_VERIFY_CHAIN); tree needs a drafter */
    int32_t tree_budget;           /* tree nodes below the root, 1..63 (32) */
    int32_t gate;                  /* the speculation controller on (1) or fixed settings (0) (1) */
    int64_t feature_ring_capacity; /* drafter context ring positions (4096) */
    int64_t drafter_window;        /* committed positions a draft attends to; 0: the drafter's trained context (0) */
    double draft_cutoff;           /* verify drafts while the product of their probabilities >= this (0: all) (0) */
    int32_t draft_vocab;           /* draft over the drafter's draft vocabulary when it has one (1) */
    int32_t use_mmap;              /* weights are the mapped file's pages (1) */
    const char * device_name;      /* NULL: `device` decides; else an Engine device string: "cpu", "gpu",
                                    * a ggml device name ("CUDA0", "Vulkan0") or "rpc://HOST:PORT" (NULL) */
    /* sequence slots, >= 1: with more than one, concurrent dfn_generate calls run batched (see
     * Threads); each slot has caches of its own (n_ctx each), on the engine's device: an n_seq whose
     * caches do not fit (a device: its free memory) is DFN_ERR_OUT_OF_MEMORY here. Added after
     * device_name: a caller compiled before it passes the smaller struct_size and gets 1 (1) */
    int32_t n_seq;
} dfn_engine_options;

DFN_API dfn_engine_options dfn_engine_options_default(void);

/* Loads the target GGUF and, when drafter_path is not NULL, its DFlash drafter; options NULL: the
 * defaults. On success *out is the engine (free it with dfn_engine_destroy); on failure *out is NULL. */
DFN_API dfn_status dfn_engine_create(const char * target_path, const char * drafter_path,
                                     const dfn_engine_options * options, dfn_engine ** out);
/* Frees the engine: DFN_OK (NULL: nothing to do). A handle destroyed already, or used after its
 * destroy by any function here, gets DFN_ERR_INVALID_ARGUMENT (accessors: -1) instead of a crash, as
 * long as no newer engine has been given the same address; an engine running a dfn_generate is not
 * destroyed (DFN_ERR_INVALID_ARGUMENT). A pointer that never came from dfn_engine_create is refused
 * the same way. (It returned void in earlier builds: callers that ignore the result are unaffected.) */
DFN_API dfn_status dfn_engine_destroy(dfn_engine * engine);

DFN_API int32_t dfn_engine_n_vocab(const dfn_engine * engine);     /* rows of the embedding; -1 for NULL or a dead handle */
DFN_API int64_t dfn_engine_n_ctx(const dfn_engine * engine);       /* -1 for NULL or a dead handle */
DFN_API int32_t dfn_engine_block_size(const dfn_engine * engine);  /* 0 without a drafter; -1 for NULL */
DFN_API int32_t dfn_engine_eos_token(const dfn_engine * engine);   /* -1: none (or no vocabulary) */

/* ---- text ------------------------------------------------------------------------------------ */

/* Token ids of UTF-8 text (n_text bytes), as llama.cpp tokenizes it on the same GGUF (BOS/EOS as
 * the vocabulary asks, special-token text parsed). Writes up to `capacity` ids; *n_tokens is the
 * number of ids (on DFN_ERR_BUFFER_TOO_SMALL: the capacity needed, nothing useful written). */
DFN_API dfn_status dfn_tokenize(const dfn_engine * engine, const char * text, size_t n_text, int32_t * tokens,
                                size_t capacity, size_t * n_tokens);

/* The bytes of the tokens' pieces, concatenated, into `text` (capacity bytes), followed by a NUL
 * when there is room. *n_bytes is their number without the NUL (on DFN_ERR_BUFFER_TOO_SMALL: the
 * bytes needed, without the NUL). The bytes are UTF-8 except where a cut splits a character. */
DFN_API dfn_status dfn_detokenize(const dfn_engine * engine, const int32_t * tokens, size_t n_tokens, char * text,
                                  size_t capacity, size_t * n_bytes);

/* ---- generation ------------------------------------------------------------------------------ */

/* temperature 0: greedy. > 0: the filters top_k (0: off), top_p (in (0, 1], 1: off), min_p
 * (in [0, 1), 0: off), then a draw from softmax(kept logits / temperature) with noise fixed by
 * (seed, position, token): speculative output equals AR output at the same seed. */
struct dfn_constraint;

typedef struct dfn_generate_params {
    size_t struct_size;  /* sizeof(dfn_generate_params) */
    double temperature;  /* (0) */
    int32_t top_k;       /* (0) */
    double top_p;        /* (1) */
    double min_p;        /* (0) */
    uint64_t seed;       /* (0) */
    int32_t speculative; /* -1: with the drafter when there is one; 0: plain AR; 1: speculative (-1) */
    /* structured output: every token is chosen under this constraint's mask (see dfn_constraint);
       NULL: none. Added in 0.1 after the first release: a caller compiled without it passes the
       smaller struct_size and gets NULL (NULL) */
    const struct dfn_constraint * constraint;
} dfn_generate_params;

DFN_API dfn_generate_params dfn_generate_params_default(void);

/* ---- structured output ------------------------------------------------------------------------ */

/* A constraint on the tokens dfn_generate may produce (a grammar matcher, a JSON-schema matcher, an
 * automaton), written by the caller as callbacks over its own state (user_data), for one request
 * at a time. dfn_generate chooses every token from logits masked by it: each AR step, every verify
 * row (chain or tree, the constraint advanced along the drafted path and rolled back to the
 * accepted prefix) and each draft (masked drafts are accepted more often). The output is the
 * constrained AR output bit for bit, greedy and sampled, chain and tree. The same core runs
 * Engine.generate(constraint=...) in Python (there over xgrammar).
 *
 * The constraint's state is the sequence of tokens it accepted since dfn_generate began (set it up
 * before the call: the first mask asked is the first generated token's). Every callback gets
 * user_data and returns an int; a negative return is an error: dfn_generate stops and returns
 * DFN_ERR_CONSTRAINT, dfn_last_error() naming the callback and the value it returned. The engine is
 * left as usable as after any other request (the next dfn_generate starts afresh); the tokens
 * emitted before the error are in out[0 .. *n_out). On an engine of one slot the callbacks run on
 * the calling thread, inside dfn_generate: they may call dfn_detokenize, dfn_engine_n_vocab or
 * dfn_engine_eos_token on the engine, and a dfn_generate on it is refused (see Threads). With
 * n_seq > 1 they run on whichever caller's thread runs the engine's step (see Threads), one call
 * at a time: a constraint must not rely on the thread it runs on.
 *
 * A token the mask allows that accept then rejects, or a mask that allows no token while the
 * request goes on, fails the call with DFN_ERR_RUNTIME ("... the constraint allows no token at
 * position N"). End the output by allowing an end-of-generation token (dfn_engine_eos_token): once
 * accepted, is_terminated returns 1 and the request stops there (DFN_STOP_EOS); max_tokens and the
 * context may end it before. */
typedef struct dfn_constraint {
    size_t struct_size; /* sizeof(dfn_constraint) */
    void * user_data;   /* passed to every callback */
    /* The tokens allowed next, as a bitmask: mask[n_words], n_words = (dfn_engine_n_vocab + 31) / 32,
       bit (t % 32) of mask[t / 32] set when token t is allowed. The mask arrives all zero: set the
       allowed tokens' bits (none once terminated). 0: done; negative: an error. */
    int (*fill_mask)(void * user_data, uint32_t * mask, size_t n_words);
    /* Advance by token: 1 accepted; 0 rejected (the state unchanged; drafts end at a rejected one);
       negative: an error. It must accept exactly the tokens fill_mask would allow: a greedy step
       offers the logits' argmax to accept first and asks for the mask only when it is rejected. */
    int (*accept)(void * user_data, int32_t token);
    /* Undo the last n accepted tokens (n >= 1; never more than DFN_MAX_BLOCK_SIZE, never a token
       dfn_generate has emitted). 0: done; negative: an error. */
    int (*rollback)(void * user_data, size_t n);
    /* 1 when the last accepted token ended the output (a stop token: nothing may follow); 0: more
       may follow; negative: an error. */
    int (*is_terminated)(void * user_data);
} dfn_constraint;

/* Called once per generated token, in order; return non-zero to stop after this token. It may call
 * dfn_detokenize and dfn_engine_last_stats on the engine; a dfn_generate on it is refused on an
 * engine with n_seq = 1 and runs as one more request with n_seq > 1 (see Threads);
 * dfn_engine_destroy on it is refused with DFN_ERR_INVALID_ARGUMENT (stop, then destroy after the return). */
typedef int (*dfn_token_callback)(int32_t token, void * user_data);

typedef enum dfn_stop_reason {
    DFN_STOP_NONE = 0,      /* no generate yet (or it failed) */
    DFN_STOP_EOS = 1,       /* an end-of-generation token (not written to the output) */
    DFN_STOP_LENGTH = 2,    /* max_tokens tokens */
    DFN_STOP_CONTEXT = 3,   /* n_ctx is full */
    DFN_STOP_CALLBACK = 4   /* the callback returned non-zero */
} dfn_stop_reason;

/* Generates up to max_tokens tokens after the prompt into out[0 .. max_tokens) (the caller's
 * buffer); *n_out is how many were written. params NULL: greedy, with the drafter when there is
 * one, no constraint. callback may be NULL. Tokens equal dflash_native.Engine.generate's for the
 * same settings (and constraint). */
DFN_API dfn_status dfn_generate(dfn_engine * engine, const int32_t * prompt, size_t n_prompt,
                                const dfn_generate_params * params, int32_t * out, size_t max_tokens,
                                dfn_token_callback callback, void * user_data, size_t * n_out);

#define DFN_MAX_BLOCK_SIZE 64

/* The last dfn_generate's statistics (also after a stop by the callback); on an engine with
 * n_seq > 1, the calling thread's last dfn_generate on it (DFN_STOP_NONE and zeros before its first). */
typedef struct dfn_stats {
    size_t struct_size;          /* sizeof(dfn_stats) */
    int64_t n_prompt_tokens;
    int64_t n_generated;
    double prefill_s;            /* seconds in the prefill (which gives the first token) */
    double decode_s;             /* seconds after it */
    int32_t stop_reason;         /* dfn_stop_reason */
    int32_t speculative;         /* 1 when the drafter ran */
    int32_t block_size;          /* B (0 for AR) */
    int64_t rounds;              /* speculative rounds (AR steps are not rounds) */
    int64_t ar_steps;            /* tokens committed by AR steps (the controller's; all of them once the drafter failed) */
    int64_t controller_switches;
    int64_t verified_tokens;     /* tokens through the verify passes */
    double draft_s, verify_s, rollback_s;
    int64_t acceptance_histogram[DFN_MAX_BLOCK_SIZE + 1]; /* [k]: rounds that committed k tokens */
    uint64_t seed;               /* the sampling seed (0 when greedy) */
    /* 1 when the engine's drafter has failed (a draft with NaN / inf logits): from that round on
       every speculative step of this engine is an AR step, with AR's output
       (dfn_engine_drafter_failure says why) */
    int32_t drafter_failed;
    /* A request with params->constraint: the seconds spent in its callbacks (fill_mask, accept,
       rollback, is_terminated) and the masks it filled (every AR step, verify row and draft the
       grammar masked); 0 without one. */
    double constraint_s;
    int64_t n_masks;
} dfn_stats;

/* Why the engine's drafter failed ("" while it is healthy, or without one; NULL for NULL or a dead
   handle): a draft whose logits were not finite (NaN / inf weights). The engine then decodes AR, with
   AR's output, for the rest of its life (n_seq > 1: the first failure a finished dfn_generate saw, in
   any slot; the slot it failed in decodes AR). The text lives as long as the engine. */
DFN_API const char * dfn_engine_drafter_failure(const dfn_engine * engine);

/* Copies the last generate's statistics into *stats (stats->struct_size set by the caller). */
DFN_API dfn_status dfn_engine_last_stats(const dfn_engine * engine, dfn_stats * stats);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_NATIVE_H */
