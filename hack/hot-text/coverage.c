// The coverage runtime of hack/hot-text.sh's profiling build (LLVM's SanitizerCoverage with
// trace-pc-guard at function level): each instrumented function's first call writes one
// address inside it to $SETTLE_COVERAGE_OUT.<pid>, after the address of the guard's init
// function (from which the reader finds where the binary was loaded). Each function once:
// its guard is cleared on the first call.
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int out = -1;

void __sanitizer_cov_trace_pc_guard_init(uint32_t *start, uint32_t *stop) {
    static uint32_t n;
    if (start == stop || *start) return;
    for (uint32_t *g = start; g < stop; g++) *g = ++n;
    if (out >= 0) return;
    // Only the profiled run records: build scripts and proc macros of the profiling build are
    // instrumented too, and run without it.
    const char *prefix = getenv("SETTLE_COVERAGE_OUT");
    if (!prefix) return;
    char path[1024];
    snprintf(path, sizeof path, "%s.%d", prefix, (int)getpid());
    out = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    uintptr_t base = (uintptr_t)&__sanitizer_cov_trace_pc_guard_init;
    if (out >= 0 && write(out, &base, sizeof base) != sizeof base) out = -1;
}

void __sanitizer_cov_trace_pc_guard(uint32_t *guard) {
    if (!*guard) return;
    *guard = 0;
    uintptr_t pc = (uintptr_t)__builtin_return_address(0);
    if (out >= 0 && write(out, &pc, sizeof pc) != sizeof pc) out = -1;
}
