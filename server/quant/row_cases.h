/* The rows one pass over a block of weights serves, and ROWS_CASES(call): call(R) with that
 * pass's row count, r (1..ROWS, in scope), as the constant R, so each count compiles to its own
 * unrolled loops (avx2_gemm.c, avx512_gemm.c; amx_gemm.c through the latter). Six: in
 * avx2_gemm.c 12 int32 sums fill the registers (madd_acc). */
#ifndef LOCALSERVE_ROW_CASES_H
#define LOCALSERVE_ROW_CASES_H
#define ROWS 6
#define ROWS_CASES(call)                                                                   \
    switch (r) {                                                                           \
        case 6: call(6); break; case 5: call(5); break; case 4: call(4); break;            \
        case 3: call(3); break; case 2: call(2); break; default: call(1);                  \
    }
#endif
