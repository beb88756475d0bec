/*
 * dsv4-plan: print the memory plan for one or more params files.
 *
 *   dsv4-plan [--json] PARAMS.json [PARAMS.json ...]
 *
 * With several files, the plans are followed by their summaries side by side, e.g. the same
 * prefill node with `hicache.ratio: 2.0` and with `hicache.size_bytes: "150GB"`.
 * Exit status: 0 when every plan was computed, 1 when dsv4 refused one, 2 on usage errors.
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

int main(int argc, char **argv) {
    int json = 0, first = 1;
    if (argc > 1 && strcmp(argv[1], "--json") == 0) {
        json = 1;
        first = 2;
    }
    int files = argc - first;
    if (files < 1 || files > MAX_FILES) {
        fprintf(stderr, "usage: %s [--json] PARAMS.json [PARAMS.json ...] (at most %d files)\n",
                argv[0], MAX_FILES);
        return 2;
    }
    if (strcmp(dsv4_version(), DSV4_VERSION_STRING) != 0) {
        fprintf(stderr, "warning: header %s but library %s\n", DSV4_VERSION_STRING,
                dsv4_version());
    }
    summary summaries[MAX_FILES];
    char *texts[MAX_FILES] = {0};
    int failed = 0;
    for (int i = 0; i < files; i++) {
        const char *path = argv[first + i];
        char *params = read_file(path);
        if (!params) return 1;
        dsv4_status status;
        texts[i] = call_with_buffer(json ? dsv4_plan : dsv4_plan_text, params, &status);
        free(params);
        if (!texts[i]) {
            fprintf(stderr, "%s: %s: %s\n", path, dsv4_status_name(status), dsv4_last_error());
            failed = 1;
            continue;
        }
        if (files > 1) printf("== %s ==\n", path);
        fputs(texts[i], stdout);
        if (json) putchar('\n');
        if (files > 1) putchar('\n');
        parse_summary(texts[i], base_name(path), &summaries[i]);
    }
    if (!json && !failed && files > 1) print_side_by_side(summaries, files);
    for (int i = 0; i < files; i++) free(texts[i]);
    return failed;
}
