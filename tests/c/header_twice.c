/* dsv4.h compiles as C11 with -Wall -Wextra -Wpedantic -Werror, and is safe to include twice. */
#include <dsv4.h>
#include <dsv4.h>

_Static_assert(sizeof(dsv4_status) == 4, "dsv4_status is int32_t");

int main(void) { return dsv4_version()[0] == '\0'; }
