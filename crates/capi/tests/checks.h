/* The check macros of the C test programs (api_checks.c, program_checks.c): a failed check is
 * counted in `failed` and printed with its line and the last call's error message. */
#ifndef AGORA_TEST_CHECKS_H
#define AGORA_TEST_CHECKS_H

#include <stdio.h>
#include <string.h>

#include "agora.h"

static int failed = 0;

#define EXPECT(cond)                                                                                 \
    do {                                                                                             \
        if (!(cond)) {                                                                               \
            failed++;                                                                                \
            fprintf(stderr, "line %d: FAILED %s (last error: \"%s\")\n", __LINE__, #cond,            \
                    agora_last_error_message());                                                     \
        }                                                                                            \
    } while (0)
#define OK(call) EXPECT((call) == AGORA_STATUS_OK)
#define MESSAGE_HAS(text) (strstr(agora_last_error_message(), (text)) != NULL)

#endif
