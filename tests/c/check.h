/* CHECK and CHECK_STATUS for the C API tests: report the failing line (and, for a status,
 * both names and dsv4_last_error()) and count it; main() returns non-zero when any failed. */
#ifndef DSV4_TEST_CHECK_H
#define DSV4_TEST_CHECK_H

#include <dsv4.h>

#include <stdio.h>

static int failures = 0;

#define CHECK(cond)                                                               \
    do {                                                                          \
        if (!(cond)) {                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                           \
        }                                                                         \
    } while (0)

#define CHECK_STATUS(call, expected)                                                          \
    do {                                                                                      \
        dsv4_status got_ = (call);                                                            \
        if (got_ != (expected)) {                                                             \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", __FILE__, \
                    __LINE__, #call, dsv4_status_name(got_), dsv4_status_name(expected),     \
                    dsv4_last_error());                                                       \
            failures++;                                                                       \
        }                                                                                     \
    } while (0)

#endif
