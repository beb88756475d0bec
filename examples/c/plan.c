/*
 * dsv4-plan: print the memory plan for one or more params files.
 *
 *   dsv4-plan [--json] PARAMS.json [PARAMS.json ...]
 *
 * With several files, the plans are followed by their summaries side by side, e.g. the same
 * prefill node with `hicache.ratio: 2.0` and with `hicache.size_bytes: "150GB"`.
 * Exit status (also in --help): 0 when every plan was computed and fits its NUMA node, 1 when
 * dsv4 refused a params file (or it could not be read), 3 when every plan was computed but one
 * does not fit, 2 on usage errors. A refusal outranks a plan that does not fit. A relative
 * model_path is looked up next to the params file first, then in the working directory.
 */
#include <dsv4.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FILES 8
#define MAX_ROWS 32

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return NULL;
    }
    size_t cap = 4096, len = 0;
    char *text = malloc(cap);
    size_t n;
    while (text && (n = fread(text + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len == 1) {
            char *grown = realloc(text, cap *= 2);
            if (!grown) {
                free(text);
                text = NULL;
            }
            text = grown;
        }
    }
    fclose(f);
    if (text) text[len] = '\0';
    return text;
}

/* A relative "model_path" is looked up next to the params file first (so a params file and its
 * checkpoint move together, as the installed share/dsv4/examples/params do), then in the
 * working directory. Returns `params` with the path rewritten, or `params` itself when it is
 * absolute, not found beside the file, or spelled with escapes (kept as written). */
static char *with_model_path_beside(char *params, const char *path) {
    const char *key = strstr(params, "\"model_path\"");
    const char *slash = strrchr(path, '/');
    if (!key || !slash) return params;
    const char *v = key + strlen("\"model_path\"");
    while (*v == ' ' || *v == '\t' || *v == '\r' || *v == '\n') v++;
    if (*v++ != ':') return params;
    while (*v == ' ' || *v == '\t' || *v == '\r' || *v == '\n') v++;
    if (*v++ != '"' || *v == '/') return params;
    const char *end = strchr(v, '"');
    size_t dir_len = (size_t)(slash - path) + 1;
    if (!end || memchr(v, '\\', (size_t)(end - v)) || strpbrk(path, "\"\\")) return params;
    size_t value_len = (size_t)(end - v), rest = strlen(end);
    char *beside = malloc(dir_len + value_len + 1);
    if (!beside) return params;
    memcpy(beside, path, dir_len);
    memcpy(beside + dir_len, v, value_len);
    beside[dir_len + value_len] = '\0';
    FILE *probe = fopen(beside, "r");
    char *out = NULL;
    if (probe) {
        fclose(probe);
        size_t head = (size_t)(v - params);
        out = malloc(head + dir_len + value_len + rest + 1);
        if (out) {
            memcpy(out, params, head);
            memcpy(out + head, beside, dir_len + value_len);
            memcpy(out + head + dir_len + value_len, end, rest + 1);
        }
    }
    free(beside);
    if (!out) return params;
    free(params);
    return out;
}

typedef dsv4_status (*plan_fn)(const char *, char *, size_t, size_t *);

/* Calls a (buf, cap, needed) function, growing the buffer until the output fits: the plan holds
 * live free-memory readings, so its size may change between calls. */
static char *call_with_buffer(plan_fn fn, const char *params, dsv4_status *status) {
    size_t needed = 0;
    *status = fn(params, NULL, 0, &needed);
    for (int attempt = 0; *status == DSV4_OK && attempt < 4; attempt++) {
        char *buf = malloc(needed + 64);
        if (!buf) return NULL;
        *status = fn(params, buf, needed + 64, &needed);
        if (*status == DSV4_OK) return buf;
        free(buf);
        if (*status == DSV4_ERR_BUFFER_TOO_SMALL) *status = DSV4_OK;
    }
    return NULL;
}

typedef struct {
    const char *name;
    char *keys[MAX_ROWS];
    char *values[MAX_ROWS];
    int rows;
} summary;

/* Splits the "summary" block at the end of a plan text into key/value rows (in place). */
static void parse_summary(char *text, const char *name, summary *out) {
    out->name = name;
    out->rows = 0;
    char *block = strstr(text, "\nsummary\n");
    if (!block) return;
    char *line = block + strlen("\nsummary\n");
    while (*line == ' ' && out->rows < MAX_ROWS) {
        char *end = strchr(line, '\n');
        if (end) *end = '\0';
        char *colon = strstr(line, ": ");
        if (colon) {
            *colon = '\0';
            out->keys[out->rows] = line + 2;
            out->values[out->rows] = colon + 2;
            out->rows++;
        }
        if (!end) break;
        line = end + 1;
    }
}

static const char *base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

static void print_side_by_side(summary *s, int n) {
    int key_width = 0, col_width[MAX_FILES] = {0};
    for (int i = 0; i < n; i++) {
        int w = (int)strlen(s[i].name);
        col_width[i] = w;
        for (int r = 0; r < s[i].rows; r++) {
            int k = (int)strlen(s[i].keys[r]), v = (int)strlen(s[i].values[r]);
            if (k > key_width) key_width = k;
            if (v > col_width[i]) col_width[i] = v;
        }
    }
    printf("side by side\n  %-*s", key_width, "");
    for (int i = 0; i < n; i++) {
        if (i + 1 < n)
            printf("  %-*s", col_width[i], s[i].name);
        else
            printf("  %s\n", s[i].name);
    }
    for (int r = 0; r < s[0].rows; r++) {
        printf("  %-*s", key_width, s[0].keys[r]);
        for (int i = 0; i < n; i++) {
            const char *value = r < s[i].rows ? s[i].values[r] : "";
            if (i + 1 < n)
                printf("  %-*s", col_width[i], value);
            else
                printf("  %s\n", value);
        }
    }
}

enum { EXIT_FITS = 0, EXIT_REFUSED = 1, EXIT_USAGE = 2, EXIT_DOES_NOT_FIT = 3 };

static void usage(FILE *to, const char *program) {
    fprintf(to,
            "usage: %s [--json] PARAMS.json [PARAMS.json ...]  (at most %d files)\n"
            "\n"
            "Prints the DeepSeek V4 memory plan of each params file (--json: dsv4_plan's JSON\n"
            "report); with several files, their summaries side by side. A relative model_path\n"
            "is looked up next to its params file first, then in the working directory.\n"
            "\n"
            "exit status:\n"
            "  0  every plan was computed and fits its NUMA node\n"
            "  1  dsv4 refused a params file (the message says why), or it could not be read\n"
            "  2  usage error\n"
            "  3  every plan was computed, but one does not fit its NUMA node\n"
            "     (\"fits NUMA node: no\"; an engine would refuse to start with it)\n"
            "A refusal outranks a plan that does not fit.\n",
            program, MAX_FILES);
}

/* Whether a plan's JSON report says it fits its NUMA node (`numa.fits`). The key occurs once in
 * the report, and inside a JSON string its quotes would be escaped, so the text `"fits":` can
 * only be that key. A report without it counts as not fitting. */
static int json_fits(const char *report) {
    const char *key = strstr(report, "\"fits\":");
    if (!key) return 0;
    key += strlen("\"fits\":");
    while (*key == ' ' || *key == '\n' || *key == '\t' || *key == '\r') key++;
    return strncmp(key, "true", 4) == 0;
}

int main(int argc, char **argv) {
    int json = 0, files = 0;
    const char *paths[MAX_FILES];
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            usage(stdout, argv[0]);
            return EXIT_FITS;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            fprintf(stderr, "%s: unknown option %s\n", argv[0], argv[i]);
            usage(stderr, argv[0]);
            return EXIT_USAGE;
        } else if (files == MAX_FILES) {
            fprintf(stderr, "%s: more than %d files\n", argv[0], MAX_FILES);
            usage(stderr, argv[0]);
            return EXIT_USAGE;
        } else {
            paths[files++] = argv[i];
        }
    }
    if (files < 1) {
        usage(stderr, argv[0]);
        return EXIT_USAGE;
    }
    if (strcmp(dsv4_version(), DSV4_VERSION_STRING) != 0) {
        fprintf(stderr, "warning: header %s but library %s\n", DSV4_VERSION_STRING,
                dsv4_version());
    }
    summary summaries[MAX_FILES];
    char *texts[MAX_FILES] = {0};
    int refused = 0, does_not_fit = 0;
    for (int i = 0; i < files; i++) {
        const char *path = paths[i];
        char *params = read_file(path);
        if (!params) {
            refused = 1;
            continue;
        }
        params = with_model_path_beside(params, path);
        dsv4_status status;
        texts[i] = call_with_buffer(json ? dsv4_plan : dsv4_plan_text, params, &status);
        /* The fit is read from the JSON report, the table is for people. */
        char *report = texts[i] && !json ? call_with_buffer(dsv4_plan, params, &status)
                                         : texts[i];
        free(params);
        if (!texts[i] || !report) {
            fprintf(stderr, "%s: %s: %s\n", path, dsv4_status_name(status), dsv4_last_error());
            refused = 1;
            if (report != texts[i]) free(report);
            free(texts[i]);
            texts[i] = NULL;
            continue;
        }
        if (!json_fits(report)) does_not_fit = 1;
        if (report != texts[i]) free(report);
        if (files > 1) printf("== %s ==\n", path);
        fputs(texts[i], stdout);
        if (json) putchar('\n');
        if (files > 1) putchar('\n');
        parse_summary(texts[i], base_name(path), &summaries[i]);
    }
    if (!json && !refused && files > 1) print_side_by_side(summaries, files);
    for (int i = 0; i < files; i++) free(texts[i]);
    if (refused) return EXIT_REFUSED;
    return does_not_fit ? EXIT_DOES_NOT_FIT : EXIT_FITS;
}
