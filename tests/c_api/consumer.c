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
 *   dfn_consumer overlap TARGET DRAFTER
 *       a dfn_generate on an engine while it runs one: from its token callback and from a second
 *       thread; prints their statuses and whether the running call's tokens are the undisturbed ones.
 */
#include <dflash_native.h>

#include <pthread.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

static int cmd_generate(char ** argv) {
    const char * drafter = strcmp(argv[3], "-") == 0 ? NULL : argv[3];
    dfn_engine_options o = dfn_engine_options_default();
    o.n_ctx = 1024;
    o.n_threads = 2;
    o.verify = strcmp(argv[9], "tree") == 0 ? DFN_VERIFY_TREE : DFN_VERIFY_CHAIN;
    dfn_engine * e = NULL;
    dfn_status s = dfn_engine_create(argv[2], drafter, &o, &e);
    if (s != DFN_OK) return die("create", s);

    int32_t prompt[4096];
    size_t n_prompt = 0;
    s = dfn_tokenize(e, argv[4], strlen(argv[4]), prompt, 4096, &n_prompt);
    if (s != DFN_OK) return die("tokenize", s);
    print_ids("prompt", prompt, n_prompt);

    dfn_generate_params g = dfn_generate_params_default();
    g.temperature = atof(argv[6]);
    g.seed = strtoull(argv[7], NULL, 10);
    size_t max_tokens = (size_t) atoi(argv[5]);
    int left = atoi(argv[8]);
    int32_t * out = malloc((max_tokens + 1) * sizeof(int32_t));
    size_t n_out = 0;
    s = dfn_generate(e, prompt, n_prompt, &g, out, max_tokens, left > 0 ? stop_after_cb : NULL, &left, &n_out);
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
    free(out);
    dfn_engine_destroy(e);
    return 0;
}

static void report(const char * name, dfn_status s) {
    printf("%s: %s | %s\n", name, dfn_status_name(s), s == DFN_OK ? "" : dfn_last_error());
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

int main(int argc, char ** argv) {
    if (argc == 10 && strcmp(argv[1], "generate") == 0) return cmd_generate(argv);
    if (argc == 3 && strcmp(argv[1], "errors") == 0) return cmd_errors(argv[2]);
    if (argc == 4 && strcmp(argv[1], "create") == 0) return cmd_create(argv);
    if (argc == 4 && strcmp(argv[1], "overlap") == 0) return cmd_overlap(argv);
    if (argc == 4 && strcmp(argv[1], "fork") == 0) return cmd_fork(argv);
    fprintf(stderr, "usage: dfn_consumer generate TARGET DRAFTER|- PROMPT MAX_TOKENS TEMPERATURE SEED STOP_AFTER VERIFY\n"
                    "       dfn_consumer errors TARGET\n"
                    "       dfn_consumer create TARGET DRAFTER|-\n"
                    "       dfn_consumer overlap TARGET DRAFTER\n"
                    "       dfn_consumer fork TARGET DRAFTER\n");
    return 2;
}
