/* A C program on dflash-native's C API (tests/test_c_api.py builds and runs it).
 *
 *   dfn_consumer generate TARGET DRAFTER|- PROMPT MAX_TOKENS TEMPERATURE SEED STOP_AFTER VERIFY
 *       tokenizes PROMPT, generates (STOP_AFTER > 0: the callback stops after that many tokens;
 *       VERIFY: chain or tree) and prints "key: values" lines.
 *   dfn_consumer errors TARGET
 *       the error paths: one "case: STATUS_NAME | message" line each.
 *   dfn_consumer create TARGET DRAFTER|-
 *       dfn_engine_create alone: "create: STATUS_NAME | message".
 *   dfn_consumer fork TARGET DRAFTER
 *       dfn_generate in a fork() of the process whose engine ran, and a new 2-thread engine there:
 *       the child's status lines, then "child_exit: N" (a hang ends the child by SIGALRM) and the
 *       parent's own generate after it.
 *   dfn_consumer batched TARGET DRAFTER VERIFY
 *       an engine with n_seq = 4 (VERIFY: chain or tree): the option's statuses, then 10 dfn_generate
 *       calls from 4 threads at once (greedy and sampled, speculative and AR; one with a token id
 *       outside the vocabulary, one whose callback stops it after 5 tokens, one whose callback makes
 *       a call of its own, and a dfn_engine_destroy tried while they run), each against the same
 *       call alone on an n_seq = 1 engine: one "job" line per call, then how many calls' tokens
 *       interleaved, the nested call's result, each thread's last error, and more failing calls
 *       (an empty prompt, one over n_ctx) before a call that must still give the solo tokens.
 *   dfn_consumer ids TARGET DRAFTER|- N_CTX MAX_TOKENS ID...
 *       greedy dfn_generate from token ids: "tokens: ..." and "stats: STOP_REASON N_GENERATED EOS_TOKEN".
 *   dfn_consumer novocab TARGET
 *       a target whose GGUF has no vocabulary: the text calls' statuses, then a generate from ids.
 *   dfn_consumer oom TARGET
 *       under an address-space limit of 1 TiB (RLIMIT_AS): an engine whose KV cache needs 4 TiB,
 *       then a small one that generates.
 *   dfn_consumer overlap TARGET DRAFTER
 *       a dfn_generate on an engine while it runs one: from its token callback and from a second
 *       thread; prints their statuses and whether the running call's tokens are the undisturbed ones.
 *   dfn_consumer constrained TARGET DRAFTER|- VERIFY GATE PROMPT MAX_TOKENS TEMPERATURE SEED MODE BUDGET STOPS
 *                            FAIL_WHAT FAIL_AT [ID...]
 *       structured output through a dfn_constraint written here (struct automaton): MODE "set": only
 *       the tokens ID..., exactly BUDGET of them, then a stop token; MODE "digits": tokens whose
 *       pieces are ASCII digits, BUDGET digits at most, then a stop token (the regex [0-9]{1,BUDGET}).
 *       STOPS: the stop tokens, comma-separated ("-": dfn_engine_eos_token). Prints the speculative
 *       (or, without a drafter, AR) run's "tokens", "stats", "calls" and "valid" lines, then the AR
 *       run's on the same engine ("ar_tokens", "ar_valid"). FAIL_WHAT (a callback's name, "-": none):
 *       that callback returns -7 at its FAIL_AT-th call; prints the failing call's "fail" status
 *       line and "fail_tokens", then "after_tokens" (the same request without the failure) and
 *       "after_plain" (an unconstrained greedy one) on the same engine.
 */
#include <dflash_native.h>

#include <pthread.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

static int stop_after_cb(int32_t token, void * user) {
    int * left = (int *) user;
    (void) token;
    return --*left <= 0;
}

static void print_ids(const char * key, const int32_t * ids, size_t n) {
    printf("%s:", key);
    for (size_t i = 0; i < n; ++i) printf(" %d", (int) ids[i]);
    printf("\n");
}

static int die(const char * what, dfn_status s) {
    fprintf(stderr, "%s: %s | %s\n", what, dfn_status_name(s), dfn_last_error());
    return 1;
}

/* The generate commands' engine (DRAFTER "-": none; VERIFY chain or tree) and their prompt's ids
 * (prompt[4096]); 1 after printing the failure. */
static int open_engine(const char * target, const char * drafter, const char * verify, int gate, const char * text,
                       dfn_engine ** e, int32_t * prompt, size_t * n_prompt) {
    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = 1024;
    o.n_threads = 2;
    o.verify = strcmp(verify, "tree") == 0 ? DFN_VERIFY_TREE : DFN_VERIFY_CHAIN;
    o.gate = gate;
    dfn_status s = dfn_engine_create(target, strcmp(drafter, "-") == 0 ? NULL : drafter, &o, e);
    if (s != DFN_OK) return die("create", s);
    s = dfn_tokenize(*e, text, strlen(text), prompt, 4096, n_prompt);
    return s != DFN_OK ? die("tokenize", s) : 0;
}

static int cmd_generate(char ** argv) {
    dfn_engine * e = NULL;
    int32_t prompt[4096];
    size_t n_prompt = 0;
    if (open_engine(argv[2], argv[3], argv[9], 1, argv[4], &e, prompt, &n_prompt)) return 1;
    print_ids("prompt", prompt, n_prompt);

    dfn_generate_params g = dfn_generate_params_default();
    g.temperature = atof(argv[6]);
    g.seed = strtoull(argv[7], NULL, 10);
    size_t max_tokens = (size_t) atoi(argv[5]);
    int left = atoi(argv[8]);
    int32_t * out = malloc((max_tokens + 1) * sizeof(int32_t));
    size_t n_out = 0;
    dfn_status s = dfn_generate(e, prompt, n_prompt, &g, out, max_tokens, left > 0 ? stop_after_cb : NULL, &left, &n_out);
    if (s != DFN_OK) return die("generate", s);
    print_ids("tokens", out, n_out);

    char text[65536];
    size_t n_text = 0;
    s = dfn_detokenize(e, out, n_out, text, sizeof text, &n_text);
    if (s != DFN_OK) return die("detokenize", s);
    printf("text_bytes: %zu\n", n_text);

    dfn_stats st;
    st.struct_size = sizeof st;
    s = dfn_engine_last_stats(e, &st);
    if (s != DFN_OK) return die("stats", s);
    int64_t hist_rounds = 0;
    for (int k = 0; k <= DFN_MAX_BLOCK_SIZE; ++k) hist_rounds += st.acceptance_histogram[k];
    printf("stats: %d %d %lld %lld %lld %lld %d\n", st.stop_reason, st.speculative, (long long) st.n_generated,
           (long long) st.rounds, (long long) hist_rounds, (long long) st.ar_steps, st.block_size);
    const char * why = dfn_engine_drafter_failure(e);
    printf("drafter_failed: %d %d\n", st.drafter_failed, why != NULL && strstr(why, "non-finite logits") != NULL);
    free(out);
    dfn_engine_destroy(e);
    return 0;
}

static void report(const char * name, dfn_status s) {
    printf("%s: %s | %s\n", name, dfn_status_name(s), s == DFN_OK ? "" : dfn_last_error());
}

/* a constraint that allows no token */
static int none_fill(void * user, uint32_t * mask, size_t n_words) {
    (void) user, (void) mask, (void) n_words;
    return 0;
}
static int none_accept(void * user, int32_t token) {
    (void) user, (void) token;
    return 0;
}
static int none_rollback(void * user, size_t n) {
    (void) user, (void) n;
    return 0;
}
static int none_terminated(void * user) {
    (void) user;
    return 0;
}

static int cmd_errors(const char * target) {
    dfn_engine * e = NULL;
    printf("version: %s %d %s\n", dfn_version(), dfn_version_number(), DFN_VERSION_STRING);
    report("missing_file", dfn_engine_create("/nonexistent/dir/model.gguf", NULL, NULL, &e));
    printf("missing_file_handle: %s\n", e == NULL ? "null" : "set");

    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = (int64_t) 1 << 62; /* was a GGML_ASSERT (abort) in the cache's tensors */
    report("huge_n_ctx", dfn_engine_create(target, NULL, &o, &e));
    o = dfn_engine_options_default();
    o.kv_type = 7;
    report("bad_kv_type", dfn_engine_create(target, NULL, &o, &e));
    o = dfn_engine_options_default();
    o.reserved0 = 1;
    report("nonzero_reserved", dfn_engine_create(target, NULL, &o, &e));
    o = dfn_engine_options_default();
    o.n_ctx = 0;
    report("bad_n_ctx", dfn_engine_create(target, NULL, &o, &e));
    o = dfn_engine_options_default();
    o.verify = DFN_VERIFY_TREE;
    report("tree_without_drafter", dfn_engine_create(target, NULL, &o, &e));
    o = dfn_engine_options_default();
    o.struct_size = 3;
    report("bad_struct_size", dfn_engine_create(target, NULL, &o, &e));
    report("not_gguf", dfn_engine_create("/proc/self/cmdline", NULL, NULL, &e));
    o = dfn_engine_options_default();
    o.device_name = "tpu0";
    report("bad_device", dfn_engine_create(target, NULL, &o, &e));
    o = dfn_engine_options_default();
    o.device_name = "cpu";
    o.n_ctx = 64;
    report("device_cpu", dfn_engine_create(target, NULL, &o, &e));
    dfn_engine_destroy(e);
    e = NULL;
    o = dfn_engine_options_default();
    o.struct_size = offsetof(dfn_engine_options, device_name); /* a caller compiled before device_name */
    o.n_ctx = 64;
    report("options_before_device_name", dfn_engine_create(target, NULL, &o, &e));
    dfn_engine_destroy(e);
    e = NULL;

    o = dfn_engine_options_default();
    o.n_ctx = 64;
    dfn_status s = dfn_engine_create(target, NULL, &o, &e);
    report("create", s);
    if (s != DFN_OK) return 1;
    int32_t ids[2];
    size_t n = 0;
    const char * text = "def fibonacci(n):\n    return n";
    report("tokenize_small", dfn_tokenize(e, text, strlen(text), ids, 2, &n));
    printf("tokenize_needed: %zu\n", n);
    int32_t all[256];
    report("tokenize", dfn_tokenize(e, text, strlen(text), all, 256, &n));
    char buf[4];
    size_t nb = 0;
    report("detokenize_small", dfn_detokenize(e, all, n, buf, sizeof buf, &nb));
    printf("detokenize_needed: %zu\n", nb);
    int32_t bad = dfn_engine_n_vocab(e) + 5;
    report("detokenize_bad_id", dfn_detokenize(e, &bad, 1, buf, sizeof buf, &nb));
    int32_t out[8];
    size_t n_out = 0;
    report("generate_bad_id", dfn_generate(e, &bad, 1, NULL, out, 8, NULL, NULL, &n_out));
    report("generate_empty_prompt", dfn_generate(e, all, 0, NULL, out, 8, NULL, NULL, &n_out));
    dfn_generate_params g = dfn_generate_params_default();
    g.temperature = 0.8;
    g.top_p = 1.5;
    report("generate_bad_top_p", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out));
    g = dfn_generate_params_default();
    g.speculative = 1;
    report("generate_spec_without_drafter", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out));
    report("generate_defaults", dfn_generate(e, all, n, NULL, out, 8, NULL, NULL, &n_out) == DFN_OK && n_out == 8
                                     ? DFN_OK : DFN_ERR_RUNTIME);
    /* a failing call's statistics are DFN_STOP_NONE, not the successful call's before it */
    g = dfn_generate_params_default();
    g.temperature = -1.0;
    report("generate_bad_temperature", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out));
    dfn_stats st;
    st.struct_size = sizeof st;
    report("stats_after_failure", dfn_engine_last_stats(e, &st));
    printf("stats_after_failure_values: %d %lld %zu\n", st.stop_reason, (long long) st.n_generated, n_out);
    /* the constraint's checks, and a constraint that allows nothing */
    dfn_constraint c = {sizeof c, NULL, none_fill, none_accept, none_rollback, none_terminated};
    g = dfn_generate_params_default();
    g.constraint = &c;
    report("constraint_allows_nothing", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out));
    report("generate_after_constraint_failure", dfn_generate(e, all, n, NULL, out, 8, NULL, NULL, &n_out) == DFN_OK &&
                                                    n_out == 8 ? DFN_OK : DFN_ERR_RUNTIME);
    c.accept = NULL;
    c.is_terminated = NULL;
    report("constraint_null_callback", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out));
    c.accept = none_accept;
    c.is_terminated = none_terminated;
    c.struct_size = 3;
    report("constraint_bad_struct_size", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out));
    /* a caller compiled before params.constraint: whatever follows its struct is not read */
    g.struct_size = offsetof(dfn_generate_params, constraint);
    g.constraint = (const dfn_constraint *) (uintptr_t) 1;
    report("params_before_constraint", dfn_generate(e, all, n, &g, out, 8, NULL, NULL, &n_out) == DFN_OK && n_out == 8
                                           ? DFN_OK : DFN_ERR_RUNTIME);
    int32_t longp[80];
    for (int i = 0; i < 80; ++i) longp[i] = all[i % n];
    report("prompt_over_n_ctx", dfn_generate(e, longp, 80, NULL, out, 8, NULL, NULL, &n_out));
    report("null_out", dfn_generate(e, all, n, NULL, NULL, 8, NULL, NULL, &n_out));
    report("destroy", dfn_engine_destroy(e));
    report("destroy_again", dfn_engine_destroy(e));      /* a no-op that says so (was a double free) */
    report("tokenize_after_destroy", dfn_tokenize(e, text, strlen(text), all, 256, &n));
    report("generate_after_destroy", dfn_generate(e, all, 4, NULL, out, 4, NULL, NULL, &n_out));
    report("stats_after_destroy", dfn_engine_last_stats(e, &st));
    printf("n_vocab_after_destroy: %d\n", (int) dfn_engine_n_vocab(e));
    report("destroy_null", dfn_engine_destroy(NULL));
    printf("null_accessors: %d %lld %d %d\n", (int) dfn_engine_n_vocab(NULL), (long long) dfn_engine_n_ctx(NULL),
           (int) dfn_engine_block_size(NULL), (int) dfn_engine_eos_token(NULL));
    return 0;
}

static int cmd_create(char ** argv) {
    dfn_engine * e = NULL;
    report("create", dfn_engine_create(argv[2], strcmp(argv[3], "-") == 0 ? NULL : argv[3], NULL, &e));
    dfn_engine_destroy(e);
    return 0;
}

static int cmd_ids(int argc, char ** argv) {
    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = atoll(argv[4]);
    o.n_threads = 2;
    o.kv_type = DFN_KV_F32;
    dfn_engine * e = NULL;
    dfn_status s = dfn_engine_create(argv[2], strcmp(argv[3], "-") == 0 ? NULL : argv[3], &o, &e);
    if (s != DFN_OK) return die("create", s);
    size_t max_tokens = (size_t) atoi(argv[5]), n_prompt = (size_t) (argc - 6), n_out = 0;
    int32_t * prompt = malloc((n_prompt + 1) * sizeof(int32_t));
    int32_t * out = malloc((max_tokens + 1) * sizeof(int32_t));
    for (size_t i = 0; i < n_prompt; ++i) prompt[i] = atoi(argv[6 + i]);
    s = dfn_generate(e, prompt, n_prompt, NULL, out, max_tokens, NULL, NULL, &n_out);
    if (s != DFN_OK) return die("generate", s);
    print_ids("tokens", out, n_out);
    dfn_stats st;
    st.struct_size = sizeof st;
    s = dfn_engine_last_stats(e, &st);
    if (s != DFN_OK) return die("stats", s);
    printf("stats: %d %lld %d\n", st.stop_reason, (long long) st.n_generated, (int) dfn_engine_eos_token(e));
    free(prompt);
    free(out);
    dfn_engine_destroy(e);
    return 0;
}

static int cmd_novocab(char ** argv) {
    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = 64;
    o.n_threads = 1;
    dfn_engine * e = NULL;
    dfn_status s = dfn_engine_create(argv[2], NULL, &o, &e);
    report("create", s);
    if (s != DFN_OK) return 1;
    int32_t ids[16] = {1, 2, 3};
    size_t n = 7;
    report("tokenize", dfn_tokenize(e, "hi", 2, ids, 16, &n));
    printf("tokenize_n: %zu\n", n);
    char text[64];
    size_t nb = 7;
    report("detokenize", dfn_detokenize(e, ids, 3, text, sizeof text, &nb));
    printf("detokenize_n: %zu\n", nb);
    printf("eos_token: %d\n", (int) dfn_engine_eos_token(e));
    int32_t out[8];
    size_t n_out = 0;
    report("generate_ids", dfn_generate(e, ids, 3, NULL, out, 3, NULL, NULL, &n_out));
    print_ids("tokens", out, n_out);
    dfn_engine_destroy(e);
    return 0;
}

static int cmd_oom(char ** argv) {
    struct rlimit lim = {(rlim_t) 1 << 40, (rlim_t) 1 << 40};  /* 1 TiB: far above what the tiny engines use */
    if (setrlimit(RLIMIT_AS, &lim) != 0) {
        perror("setrlimit");
        return 1;
    }
    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = 2147483647; /* the largest n_ctx accepted: an F32 KV cache of ~4 TiB here */
    o.kv_type = DFN_KV_F32;
    o.n_threads = 1;
    dfn_engine * e = NULL;
    report("huge_cache", dfn_engine_create(argv[2], NULL, &o, &e));
    printf("huge_cache_handle: %s\n", e == NULL ? "null" : "set");
    o.n_ctx = 64;
    dfn_status s = dfn_engine_create(argv[2], NULL, &o, &e);
    report("small_after", s);
    if (s != DFN_OK) return 1;
    int32_t prompt[3] = {1, 2, 3}, out[4];
    size_t n_out = 0;
    report("generate_after", dfn_generate(e, prompt, 3, NULL, out, 4, NULL, NULL, &n_out));
    printf("generated_after: %zu\n", n_out);
    dfn_engine_destroy(e);
    return 0;
}

/* ---- overlap: one engine, a second dfn_generate while one runs ---- */

struct overlap {
    dfn_engine * e;
    const int32_t * prompt;
    size_t n_prompt;
    int from_thread;          /* 0: the callback calls dfn_generate itself; 1: a second thread does */
    int calls;
    dfn_status status;        /* the second call's */
    char message[512];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;                /* 1: the first call is in its callback; 2: the second call returned */
};

static void second_call(struct overlap * o) {
    int32_t out[4];
    size_t n = 0;
    o->status = dfn_generate(o->e, o->prompt, o->n_prompt, NULL, out, 4, NULL, NULL, &n);
    snprintf(o->message, sizeof o->message, "%s", o->status == DFN_OK ? "" : dfn_last_error());
}

static int overlap_cb(int32_t token, void * user) {
    struct overlap * o = (struct overlap *) user;
    (void) token;
    if (o->calls++ != 2) return 0;  /* mid-generation: after a few tokens */
    if (!o->from_thread) {
        second_call(o);
        return 0;
    }
    pthread_mutex_lock(&o->mu);
    o->state = 1;
    pthread_cond_broadcast(&o->cv);
    while (o->state != 2) pthread_cond_wait(&o->cv, &o->mu);
    pthread_mutex_unlock(&o->mu);
    return 0;
}

static void * overlap_thread(void * user) {
    struct overlap * o = (struct overlap *) user;
    pthread_mutex_lock(&o->mu);
    while (o->state != 1) pthread_cond_wait(&o->cv, &o->mu);
    pthread_mutex_unlock(&o->mu);
    second_call(o);
    pthread_mutex_lock(&o->mu);
    o->state = 2;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

static int cmd_overlap(char ** argv) {
    dfn_engine_options opt = dfn_engine_options_default();
    opt.n_ctx = 256;
    opt.n_threads = 1;
    dfn_engine * e = NULL;
    dfn_status s = dfn_engine_create(argv[2], argv[3], &opt, &e);
    if (s != DFN_OK) return die("create", s);
    int32_t prompt[64];
    size_t n_prompt = 0;
    s = dfn_tokenize(e, "def fibonacci(n):\n    ", 22, prompt, 64, &n_prompt);
    if (s != DFN_OK) return die("tokenize", s);
    int32_t want[32], got[32];
    size_t n_want = 0, n_got = 0;
    s = dfn_generate(e, prompt, n_prompt, NULL, want, 32, NULL, NULL, &n_want);
    if (s != DFN_OK) return die("generate", s);
    for (int from_thread = 0; from_thread <= 1; ++from_thread) {
        struct overlap o;
        memset(&o, 0, sizeof o);
        o.e = e, o.prompt = prompt, o.n_prompt = n_prompt, o.from_thread = from_thread;
        pthread_mutex_init(&o.mu, NULL);
        pthread_cond_init(&o.cv, NULL);
        pthread_t th;
        if (from_thread) pthread_create(&th, NULL, overlap_thread, &o);
        s = dfn_generate(e, prompt, n_prompt, NULL, got, 32, overlap_cb, &o, &n_got);
        if (from_thread) pthread_join(th, NULL);
        const char * name = from_thread ? "thread" : "callback";
        printf("%s: %s | %s\n", name, dfn_status_name(o.status), o.message);
        printf("%s_first: %s %d\n", name, dfn_status_name(s), n_got == n_want && memcmp(got, want, n_want * sizeof *got) == 0);
    }
    dfn_engine_destroy(e);
    return 0;
}

/* ---- batched: one engine with n_seq = 4, dfn_generate from several threads at once ---- */

#define N_JOBS 10
#define N_THREADS 4
#define JOB_MAX 64

struct batch_job {
    const char * text;        /* the prompt */
    double temperature, top_p;
    int32_t top_k;
    uint64_t seed;
    int speculative;
    size_t max_tokens;
    int stop_after;           /* > 0: the callback stops the call after this many tokens */
    int bad_id;               /* 1: the prompt ends with a token id outside the vocabulary */
    int nest;                 /* >= 0: at its 2nd token the callback runs that job's call (a nested dfn_generate) */
    int32_t prompt[256];
    size_t n_prompt;
    /* the same call alone, on the n_seq = 1 engine */
    int32_t want[JOB_MAX];
    size_t n_want;
    dfn_stats want_st;
    /* the batched call */
    int32_t got[JOB_MAX];
    size_t n_got, n_seen;
    dfn_status status;
    char message[512];
    dfn_stats st;
    long first_tick, last_tick;  /* the shared token counter at its first and last token */
    dfn_status nest_status;
    int nest_equal;
};

struct batch {
    dfn_engine * e;
    struct batch_job jobs[N_JOBS];
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long ticks;               /* tokens every call's callback saw, together */
    int started;              /* threads at the start line */
    int destroy_tried;        /* the main thread's dfn_engine_destroy while the calls run is done */
    dfn_status destroy_status;
    char destroy_message[512];
    char last_error[N_THREADS][512];  /* each thread's dfn_last_error() after its calls */
};

struct batch_call {
    struct batch * b;
    struct batch_job * j;
};

static dfn_generate_params batch_params(const struct batch_job * j);

static int batch_cb(int32_t token, void * user) {
    struct batch_call * c = (struct batch_call *) user;
    struct batch_job * j = c->j;
    (void) token;
    if (j->nest >= 0 && j->n_seen == 1) {  /* before its 2nd token: a call from the callback */
        const struct batch_job * o = &c->b->jobs[j->nest];
        dfn_generate_params g = batch_params(o);
        int32_t got[JOB_MAX];
        size_t n = 0;
        j->nest_status = dfn_generate(c->b->e, o->prompt, o->n_prompt, &g, got, o->max_tokens, NULL, NULL, &n);
        j->nest_equal = n == o->n_want && memcmp(got, o->want, n * sizeof(int32_t)) == 0;
    }
    pthread_mutex_lock(&c->b->mu);
    long tick = c->b->ticks++;
    if (j->n_seen++ == 0) j->first_tick = tick;
    j->last_tick = tick;
    if (j->stop_after > 0 && j->n_seen == 3) {  /* this call is running: the main thread tries to destroy the engine */
        pthread_cond_broadcast(&c->b->cv);
        while (!c->b->destroy_tried) pthread_cond_wait(&c->b->cv, &c->b->mu);
    }
    pthread_mutex_unlock(&c->b->mu);
    return j->stop_after > 0 && (int) j->n_seen >= j->stop_after;
}

static dfn_generate_params batch_params(const struct batch_job * j) {
    dfn_generate_params g = dfn_generate_params_default();
    g.temperature = j->temperature;
    g.top_p = j->top_p;
    g.top_k = j->top_k;
    g.seed = j->seed;
    g.speculative = j->speculative;
    return g;
}

static void batch_run(struct batch * b, struct batch_job * j) {
    struct batch_call c = {b, j};
    dfn_generate_params g = batch_params(j);
    j->status = dfn_generate(b->e, j->prompt, j->n_prompt, &g, j->got, j->max_tokens, batch_cb, &c, &j->n_got);
    snprintf(j->message, sizeof j->message, "%s", j->status == DFN_OK ? "" : dfn_last_error());
    j->st.struct_size = sizeof j->st;
    if (dfn_engine_last_stats(b->e, &j->st) != DFN_OK) j->st.stop_reason = -1;
}

/* thread k runs jobs k, k + 4, k + 8 (the failing call and the stopped one first) */
static const int batch_order[N_THREADS][3] = {{8, 0, 4}, {9, 1, 5}, {2, 6, -1}, {3, 7, -1}};

struct batch_thread {
    struct batch * b;
    int k;
};

static void * batch_thread_main(void * user) {
    struct batch_thread * t = (struct batch_thread *) user;
    struct batch * b = t->b;
    pthread_mutex_lock(&b->mu);  /* all at once */
    b->started += 1;
    pthread_cond_broadcast(&b->cv);
    while (b->started < N_THREADS) pthread_cond_wait(&b->cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    for (int i = 0; i < 3; ++i)
        if (batch_order[t->k][i] >= 0) batch_run(b, &b->jobs[batch_order[t->k][i]]);
    snprintf(b->last_error[t->k], sizeof b->last_error[t->k], "%s", dfn_last_error());
    return NULL;
}

static int cmd_batched(char ** argv) {
    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = 256;
    o.n_threads = 2;
    o.verify = strcmp(argv[4], "tree") == 0 ? DFN_VERIFY_TREE : DFN_VERIFY_CHAIN;
    dfn_engine * e1 = NULL, * e4 = NULL, * e = NULL;
    /* the option: its default, its checks, a caller compiled before it */
    printf("default_n_seq: %d\n", (int) o.n_seq);
    o.n_seq = 0;
    report("n_seq_zero", dfn_engine_create(argv[2], argv[3], &o, &e));
    o.n_seq = 2;
    o.device_name = "gpu";
    report("n_seq_gpu", dfn_engine_create(argv[2], argv[3], &o, &e));
    dfn_engine_destroy(e);
    e = NULL;
    o.device_name = NULL;
    o.n_seq = 4000;
    o.n_ctx = 1 << 18;  /* 4000 caches of 256 MiB (1 TiB): more than the machine's memory, refused before slot 1's */
    report("n_seq_huge", dfn_engine_create(argv[2], argv[3], &o, &e));
    printf("n_seq_huge_handle: %s\n", e == NULL ? "null" : "set");
    o.n_ctx = 256;
    o.n_seq = 4;
    o.struct_size = offsetof(dfn_engine_options, n_seq);  /* a caller compiled before n_seq: one slot */
    report("before_n_seq", dfn_engine_create(argv[2], argv[3], &o, &e1));
    if (e1 == NULL) return 1;
    o.struct_size = sizeof o;
    dfn_status s = dfn_engine_create(argv[2], argv[3], &o, &e4);
    report("create_n_seq_4", s);
    if (s != DFN_OK) return 1;

    static struct batch b;  /* static: large */
    memset(&b, 0, sizeof b);
    b.e = e4;
    pthread_mutex_init(&b.mu, NULL);
    pthread_cond_init(&b.cv, NULL);
    const char * texts[4] = {"def fibonacci(n):\n    ", "The capital of France is", "import numpy as np\n",
                             "Once upon a time, there"};
    /*                  text   temp  top_p  top_k  seed  spec  max  stop  bad */
    const struct { int text; double temperature, top_p; int top_k; uint64_t seed; int spec; size_t max; int stop, bad, nest; }
        cfg[N_JOBS] = {{0, 0.0, 1.0, 0, 0, 1, 24, 0, 0, -1},     /* greedy, speculative */
                       {1, 0.0, 1.0, 0, 0, 0, 12, 0, 0, -1},     /* greedy, AR */
                       {2, 0.8, 1.0, 0, 1234, 1, 24, 0, 0, -1},  /* sampled, speculative */
                       {3, 0.8, 1.0, 40, 99, 0, 12, 0, 0, -1},   /* sampled, AR */
                       {1, 0.0, 1.0, 0, 0, 1, 32, 0, 0, -1},
                       {0, 1.0, 0.9, 0, 7, 1, 20, 0, 0, -1},
                       {3, 0.0, 1.0, 0, 0, -1, 16, 0, 0, 2},     /* its callback runs job 2's call */
                       {2, 0.7, 1.0, 0, 5, 0, 10, 0, 0, -1},
                       {0, 0.0, 1.0, 0, 0, 1, 16, 0, 1, -1},     /* a token id outside the vocabulary */
                       {2, 0.0, 1.0, 0, 0, 1, 32, 5, 0, -1}};    /* the callback stops it after 5 tokens */
    for (int i = 0; i < N_JOBS; ++i) {
        struct batch_job * j = &b.jobs[i];
        j->text = texts[cfg[i].text];
        j->temperature = cfg[i].temperature, j->top_p = cfg[i].top_p, j->top_k = cfg[i].top_k;
        j->seed = cfg[i].seed, j->speculative = cfg[i].spec, j->max_tokens = cfg[i].max;
        j->stop_after = cfg[i].stop, j->bad_id = cfg[i].bad, j->nest = cfg[i].nest;
        s = dfn_tokenize(e1, j->text, strlen(j->text), j->prompt, 255, &j->n_prompt);
        if (s != DFN_OK) return die("tokenize", s);
        if (j->bad_id) j->prompt[j->n_prompt++] = dfn_engine_n_vocab(e1) + 5;
        if (j->bad_id) continue;
        /* alone, without the callback (the stopped call's tokens are a prefix of these) */
        dfn_generate_params g = batch_params(j);
        s = dfn_generate(e1, j->prompt, j->n_prompt, &g, j->want, j->max_tokens, NULL, NULL, &j->n_want);
        if (s != DFN_OK) return die("generate alone", s);
        j->want_st.struct_size = sizeof j->want_st;
        if ((s = dfn_engine_last_stats(e1, &j->want_st)) != DFN_OK) return die("stats alone", s);
    }

    struct batch_thread th[N_THREADS];
    pthread_t ids[N_THREADS];
    for (int k = 0; k < N_THREADS; ++k) {
        th[k].b = &b, th[k].k = k;
        pthread_create(&ids[k], NULL, batch_thread_main, &th[k]);
    }
    /* while the stopped call waits in its callback: destroy is refused */
    pthread_mutex_lock(&b.mu);
    while (b.jobs[9].n_seen < 3) pthread_cond_wait(&b.cv, &b.mu);
    pthread_mutex_unlock(&b.mu);
    b.destroy_status = dfn_engine_destroy(e4);
    snprintf(b.destroy_message, sizeof b.destroy_message, "%s", b.destroy_status == DFN_OK ? "" : dfn_last_error());
    pthread_mutex_lock(&b.mu);
    b.destroy_tried = 1;
    pthread_cond_broadcast(&b.cv);
    pthread_mutex_unlock(&b.mu);
    for (int k = 0; k < N_THREADS; ++k) pthread_join(ids[k], NULL);

    printf("destroy_while_running: %s | %s\n", dfn_status_name(b.destroy_status), b.destroy_message);
    /* job I: STATUS N_GOT N_WANT EQUAL STOP WANT_STOP N_GENERATED SPECULATIVE WANT_SPECULATIVE | message */
    for (int i = 0; i < N_JOBS; ++i) {
        const struct batch_job * j = &b.jobs[i];
        int equal = j->n_got <= j->n_want && memcmp(j->got, j->want, j->n_got * sizeof(int32_t)) == 0;
        printf("job %d: %s %zu %zu %d %d %d %lld %d %d | %s\n", i, dfn_status_name(j->status), j->n_got, j->n_want,
               equal, j->st.stop_reason, j->want_st.stop_reason, (long long) j->st.n_generated, j->st.speculative,
               j->want_st.speculative, j->message);
    }
    /* the most calls whose first-to-last token spans share a moment */
    int most = 0;
    for (int i = 0; i < N_JOBS; ++i) {
        if (b.jobs[i].n_seen == 0) continue;
        int here = 0;
        for (int k = 0; k < N_JOBS; ++k)
            if (b.jobs[k].n_seen > 0 && b.jobs[k].first_tick <= b.jobs[i].first_tick &&
                b.jobs[i].first_tick <= b.jobs[k].last_tick)
                ++here;
        if (here > most) most = here;
    }
    printf("overlap: %d\n", most);
    printf("nested: %s %d\n", dfn_status_name(b.jobs[6].nest_status), b.jobs[6].nest_equal);
    for (int k = 0; k < N_THREADS; ++k) printf("last_error %d: %s\n", k, b.last_error[k]);
    /* more failing calls, then the engine still gives the solo tokens */
    int32_t longp[300], again[JOB_MAX];
    size_t n_again = 0;
    for (int i = 0; i < 300; ++i) longp[i] = b.jobs[0].prompt[i % b.jobs[0].n_prompt];
    report("empty_prompt", dfn_generate(e4, b.jobs[0].prompt, 0, NULL, again, 8, NULL, NULL, &n_again));
    report("prompt_over_n_ctx", dfn_generate(e4, longp, 300, NULL, again, 8, NULL, NULL, &n_again));
    dfn_generate_params g = batch_params(&b.jobs[0]);
    s = dfn_generate(e4, b.jobs[0].prompt, b.jobs[0].n_prompt, &g, again, b.jobs[0].max_tokens, NULL, NULL, &n_again);
    printf("after_failures: %s %d\n", dfn_status_name(s),
           n_again == b.jobs[0].n_want && memcmp(again, b.jobs[0].want, n_again * sizeof(int32_t)) == 0);
    report("destroy_after", dfn_engine_destroy(e4));
    dfn_engine_destroy(e1);
    return 0;
}

static int cmd_fork(char ** argv) {
    dfn_engine_options opt = dfn_engine_options_default();
    opt.n_ctx = 256;
    opt.n_threads = 2;  /* ggml's OpenMP pool: what a fork() does not copy */
    dfn_engine * e = NULL;
    dfn_status s = dfn_engine_create(argv[2], argv[3], &opt, &e);
    if (s != DFN_OK) return die("create", s);
    const int32_t prompt[3] = {5, 6, 7};
    int32_t want[16], got[16];
    size_t n_want = 0, n_got = 0;
    s = dfn_generate(e, prompt, 3, NULL, want, 16, NULL, NULL, &n_want);
    if (s != DFN_OK) return die("generate", s);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20);
        report("child", dfn_generate(e, prompt, 3, NULL, got, 16, NULL, NULL, &n_got));
        dfn_engine * e2 = NULL;  /* a new engine on 2 threads: a new OpenMP pool, which cannot start here */
        report("child_create", dfn_engine_create(argv[2], argv[3], &opt, &e2));
        dfn_engine_destroy(e2);
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    printf("child_exit: %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    s = dfn_generate(e, prompt, 3, NULL, got, 16, NULL, NULL, &n_got);
    printf("parent: %s %d\n", dfn_status_name(s), n_got == n_want && memcmp(got, want, n_want * sizeof *got) == 0);
    dfn_engine_destroy(e);
    return 0;
}

/* ---- constrained: structured output through a C automaton ---- */

enum { CB_FILL, CB_ACCEPT, CB_ROLLBACK, CB_TERMINATED, CB_N };
static const char * const cb_names[CB_N] = {"fill_mask", "accept", "rollback", "is_terminated"};

/* The tokens the automaton accepted are a stack: a rollback pops them. Allowed next: a token of
 * weight w > 0 while used + w <= budget, a stop token once used >= min_used; nothing after a stop. */
struct automaton {
    int32_t n_vocab;
    int32_t * weight;        /* [n_vocab]: 0 not allowed, else what the token uses of the budget */
    char * stop;             /* [n_vocab]: a stop token */
    int64_t budget, min_used;
    int32_t * stack;         /* the accepted tokens */
    int64_t n_stack, capacity, used;
    int terminated;
    long calls[CB_N];
    int64_t max_rollback;
    int fail_what;           /* -1: none */
    long fail_at;
};

static int injected(struct automaton * a, int what) {
    return ++a->calls[what] == a->fail_at && a->fail_what == what;
}

static int allows(const struct automaton * a, int32_t t) {
    if (a->terminated || t < 0 || t >= a->n_vocab) return 0;
    if (a->stop[t]) return a->used >= a->min_used;
    return a->weight[t] > 0 && a->used + a->weight[t] <= a->budget;
}

static int am_fill_mask(void * user, uint32_t * mask, size_t n_words) {
    struct automaton * a = (struct automaton *) user;
    if (injected(a, CB_FILL)) return -7;
    for (int32_t t = 0; t < a->n_vocab && (size_t) (t / 32) < n_words; ++t) {
        if (allows(a, t)) mask[t / 32] |= 1u << (t % 32);
    }
    return 0;
}

static int am_accept(void * user, int32_t token) {
    struct automaton * a = (struct automaton *) user;
    if (injected(a, CB_ACCEPT)) return -7;
    if (!allows(a, token)) return 0;
    if (a->n_stack == a->capacity) return -100;  /* more than max_tokens + a round: the library's bug */
    a->stack[a->n_stack++] = token;
    if (a->stop[token]) a->terminated = 1;
    else a->used += a->weight[token];
    return 1;
}

static int am_rollback(void * user, size_t n) {
    struct automaton * a = (struct automaton *) user;
    if (injected(a, CB_ROLLBACK)) return -7;
    if (n == 0 || (int64_t) n > a->n_stack || n > DFN_MAX_BLOCK_SIZE) return -101;  /* outside the header's promise */
    if ((int64_t) n > a->max_rollback) a->max_rollback = (int64_t) n;
    for (size_t i = 0; i < n; ++i) {
        int32_t t = a->stack[--a->n_stack];
        if (a->stop[t]) a->terminated = 0;
        else a->used -= a->weight[t];
    }
    return 0;
}

static int am_is_terminated(void * user) {
    struct automaton * a = (struct automaton *) user;
    if (injected(a, CB_TERMINATED)) return -7;
    return a->terminated;
}

static void am_reset(struct automaton * a) {
    a->n_stack = a->used = a->max_rollback = 0;
    a->terminated = 0;
    memset(a->calls, 0, sizeof a->calls);
}

static dfn_constraint am_constraint(struct automaton * a) {
    dfn_constraint c;
    c.struct_size = sizeof c;
    c.user_data = a;
    c.fill_mask = am_fill_mask;
    c.accept = am_accept;
    c.rollback = am_rollback;
    c.is_terminated = am_is_terminated;
    return c;
}

/* Whether tokens (and the stop token that ended them, when stop_reason is EOS) are a path of the
 * automaton from its start, each allowed by its mask. */
static int am_valid(struct automaton * a, const int32_t * tokens, size_t n, int stop_reason) {
    int fail_what = a->fail_what;
    a->fail_what = -1;
    am_reset(a);
    int ok = 1;
    for (size_t i = 0; i < n && ok; ++i) ok = !a->stop[tokens[i]] && am_accept(a, tokens[i]) == 1;
    if (ok && stop_reason == DFN_STOP_EOS) {  /* one of the stop tokens ended it: one was allowed */
        int32_t t = 0;
        while (t < a->n_vocab && !(a->stop[t] && allows(a, t))) ++t;
        ok = t < a->n_vocab;
    }
    a->fail_what = fail_what;
    am_reset(a);
    return ok;
}

static dfn_status run_constrained(dfn_engine * e, const int32_t * prompt, size_t n_prompt, dfn_generate_params g,
                                  struct automaton * a, int32_t * out, size_t max_tokens, size_t * n_out,
                                  dfn_stats * st) {
    am_reset(a);
    dfn_constraint c = am_constraint(a);
    g.constraint = &c;
    dfn_status s = dfn_generate(e, prompt, n_prompt, &g, out, max_tokens, NULL, NULL, n_out);
    st->struct_size = sizeof *st;
    dfn_engine_last_stats(e, st);
    return s;
}

static int cmd_constrained(int argc, char ** argv) {
    dfn_engine * e = NULL;
    int32_t prompt[4096];
    size_t n_prompt = 0;
    if (open_engine(argv[2], argv[3], argv[4], atoi(argv[5]), argv[6], &e, prompt, &n_prompt)) return 1;
    const int drafter = dfn_engine_block_size(e) > 0;
    dfn_status s;

    size_t max_tokens = (size_t) atoi(argv[7]);
    dfn_generate_params g = dfn_generate_params_default();
    g.temperature = atof(argv[8]);
    g.seed = strtoull(argv[9], NULL, 10);

    struct automaton a;
    memset(&a, 0, sizeof a);
    a.n_vocab = dfn_engine_n_vocab(e);
    a.weight = calloc((size_t) a.n_vocab, sizeof *a.weight);
    a.stop = calloc((size_t) a.n_vocab, 1);
    a.capacity = (int64_t) max_tokens + DFN_MAX_BLOCK_SIZE + 1;
    a.stack = malloc((size_t) a.capacity * sizeof *a.stack);
    a.budget = atoll(argv[11]);
    if (strcmp(argv[10], "set") == 0) {
        for (int i = 15; i < argc; ++i) a.weight[atoi(argv[i])] = 1;
        a.min_used = a.budget;
    } else {  /* digits: a token whose piece is 1.. ASCII digits weighs its length */
        for (int32_t t = 0; t < a.n_vocab; ++t) {
            char piece[256];
            size_t nb = 0;
            if (dfn_detokenize(e, &t, 1, piece, sizeof piece, &nb) != DFN_OK || nb == 0) continue;
            size_t k = 0;
            while (k < nb && piece[k] >= '0' && piece[k] <= '9') ++k;
            if (k == nb) a.weight[t] = (int32_t) nb;
        }
        a.min_used = 1;
    }
    if (strcmp(argv[12], "-") == 0) {
        a.stop[dfn_engine_eos_token(e)] = 1;
    } else {
        for (char * p = argv[12]; *p;) {
            a.stop[strtol(p, &p, 10)] = 1;
            if (*p == ',') ++p;
        }
    }
    for (int32_t t = 0; t < a.n_vocab; ++t) if (a.stop[t]) a.weight[t] = 0;
    int64_t n_allowed = 0;
    for (int32_t t = 0; t < a.n_vocab; ++t) n_allowed += a.weight[t] > 0;
    printf("allowed: %lld\n", (long long) n_allowed);
    a.fail_what = -1;
    for (int k = 0; k < CB_N; ++k) if (strcmp(argv[13], cb_names[k]) == 0) a.fail_what = k;
    a.fail_at = atol(argv[14]);

    int32_t * out = malloc((max_tokens + 1) * sizeof(int32_t));
    size_t n_out = 0;
    dfn_stats st;
    if (a.fail_what >= 0) {
        s = run_constrained(e, prompt, n_prompt, g, &a, out, max_tokens, &n_out, &st);
        printf("fail: %s | %s\n", dfn_status_name(s), s == DFN_OK ? "" : dfn_last_error());
        print_ids("fail_tokens", out, n_out);
        printf("fail_stats: %d\n", st.stop_reason);
        a.fail_what = -1;
        s = run_constrained(e, prompt, n_prompt, g, &a, out, max_tokens, &n_out, &st);
        if (s != DFN_OK) return die("generate after the failure", s);
        print_ids("after_tokens", out, n_out);
        const char * why = dfn_engine_drafter_failure(e);
        printf("after_stats: %d %lld %d %d\n", st.speculative, (long long) st.rounds, st.drafter_failed,
               why != NULL && why[0] != '\0');
        s = dfn_generate(e, prompt, n_prompt, NULL, out, max_tokens, NULL, NULL, &n_out);
        if (s != DFN_OK) return die("plain generate after the failure", s);
        print_ids("after_plain", out, n_out);
    } else {
        s = run_constrained(e, prompt, n_prompt, g, &a, out, max_tokens, &n_out, &st);
        if (s != DFN_OK) return die("generate", s);
        print_ids("tokens", out, n_out);
        int64_t hist_rounds = 0, hist_tokens = 0;
        for (int k = 0; k <= DFN_MAX_BLOCK_SIZE; ++k) hist_rounds += st.acceptance_histogram[k];
        for (int k = 0; k <= DFN_MAX_BLOCK_SIZE; ++k) hist_tokens += k * st.acceptance_histogram[k];
        /* stop reason, speculative, rounds, tokens those rounds committed, AR steps */
        printf("stats: %d %d %lld %lld %lld\n", st.stop_reason, st.speculative, (long long) hist_rounds,
               (long long) hist_tokens, (long long) st.ar_steps);
        printf("calls: %ld %ld %ld %ld %lld\n", a.calls[CB_FILL], a.calls[CB_ACCEPT], a.calls[CB_ROLLBACK],
               a.calls[CB_TERMINATED], (long long) a.max_rollback);
        /* the statistics' count of the masks and whether its callbacks' time was counted */
        printf("constraint_stats: %lld %d\n", (long long) st.n_masks, st.constraint_s > 0);
        printf("valid: %d\n", am_valid(&a, out, n_out, st.stop_reason));
        if (drafter) {
            g.speculative = 0;
            s = run_constrained(e, prompt, n_prompt, g, &a, out, max_tokens, &n_out, &st);
            if (s != DFN_OK) return die("generate (AR)", s);
            print_ids("ar_tokens", out, n_out);
            printf("ar_stats: %d %d\n", st.stop_reason, st.speculative);
            printf("ar_valid: %d\n", am_valid(&a, out, n_out, st.stop_reason));
        }
    }
    free(out);
    free(a.weight);
    free(a.stop);
    free(a.stack);
    dfn_engine_destroy(e);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc == 10 && strcmp(argv[1], "generate") == 0) return cmd_generate(argv);
    if (argc == 3 && strcmp(argv[1], "errors") == 0) return cmd_errors(argv[2]);
    if (argc == 4 && strcmp(argv[1], "create") == 0) return cmd_create(argv);
    if (argc >= 7 && strcmp(argv[1], "ids") == 0) return cmd_ids(argc, argv);
    if (argc == 3 && strcmp(argv[1], "novocab") == 0) return cmd_novocab(argv);
    if (argc == 3 && strcmp(argv[1], "oom") == 0) return cmd_oom(argv);
    if (argc == 4 && strcmp(argv[1], "overlap") == 0) return cmd_overlap(argv);
    if (argc == 5 && strcmp(argv[1], "batched") == 0) return cmd_batched(argv);
    if (argc == 4 && strcmp(argv[1], "fork") == 0) return cmd_fork(argv);
    if (argc >= 15 && strcmp(argv[1], "constrained") == 0) return cmd_constrained(argc, argv);
    fprintf(stderr, "usage: dfn_consumer generate TARGET DRAFTER|- PROMPT MAX_TOKENS TEMPERATURE SEED STOP_AFTER VERIFY\n"
                    "       dfn_consumer errors TARGET\n"
                    "       dfn_consumer create TARGET DRAFTER|-\n"
                    "       dfn_consumer ids TARGET DRAFTER|- N_CTX MAX_TOKENS ID...\n"
                    "       dfn_consumer novocab TARGET\n"
                    "       dfn_consumer oom TARGET\n"
                    "       dfn_consumer batched TARGET DRAFTER VERIFY\n"
                    "       dfn_consumer overlap TARGET DRAFTER\n"
                    "       dfn_consumer fork TARGET DRAFTER\n"
                    "       dfn_consumer constrained TARGET DRAFTER|- VERIFY GATE PROMPT MAX_TOKENS TEMPERATURE SEED "
                    "MODE BUDGET STOPS FAIL_WHAT FAIL_AT [ID...]\n");
    return 2;
}
