/* Conv weight folds, natively and without the interpreter lock: compensated rounding of
 * float16 rows (compensate), the steps of a fold but its probes (fold_block: widen, scale,
 * round to nearest, count flushes, compensate, onnxruntime's own fold), float16 -> float64
 * (widen), each row's largest magnitude (largest), and float32 weights scaled per row
 * (scale_rows, the float32 Conv fold).  Each gives numpy's values bit for bit
 * (graphopt.opt.numerics.float16_fold, opt/halfcast).
 *
 * Compensated rounding: the same result as graphopt.opt.numerics.float16_fold's numpy implementation
 * (rounding_moves + _cheapest_flips, rows sorted whole): per row, the values whose move to their
 * other float16 neighbour helps the row's summed rounding error are ordered by what the move
 * adds to their own error (ties by column), and the first `count` move, `count` minimizing
 * |total + their moves| + 2 * their costs (the first minimum).  Every sum is formed in numpy's
 * order: the row's total pairwise as numpy.sum does, the running sums sequentially as
 * numpy.cumsum does.  Built with -ffp-contract=off so that no sum is fused into another.
 *
 * A row is never sorted whole: its moves are taken in order from an incremental quicksort, the
 * cheapest first (those up to a cost sampled so that about 2 * sqrt(length) lie below it), until
 * no longer count can beat the best found (twice the costs taken reach it); a row needs about
 * sqrt(length) moves.  The loops over a row's values have no branches (which values move is
 * random) and vectorize.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* all bits set where `flag` (0 or 1), none where not: selects without branches, which the
 * signs and magnitudes of weights would mispredict half the time */
static inline uint64_t mask_of(uint64_t flag)
{
    return (uint64_t)0 - flag;
}

static inline double half_to_double(uint16_t h)
{
    uint64_t mag = h & 0x7FFF, sign = (uint64_t)(h & 0x8000) << 48;
    /* normal: the exponent rebiased (15 -> 1023) and the mantissa widened, on the bits;
     * infinity and NaN: the largest exponent; zero and subnormal: an exact multiple of 2^-24 */
    uint64_t normal = (mag + ((uint64_t)(1023 - 15) << 10)) << 42;
    uint64_t special = 0x7FF0000000000000ULL | ((mag & 0x03FF) << 42);
    double tiny = (double)mag * 0x1p-24;
    uint64_t tiny_bits, is_special = mask_of(mag >= 0x7C00), is_tiny = mask_of(mag < 0x0400);
    memcpy(&tiny_bits, &tiny, sizeof tiny_bits);
    uint64_t bits = (special & is_special) | (normal & ~is_special);
    bits = ((tiny_bits & is_tiny) | (bits & ~is_tiny)) | sign;
    double v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* `x` rounded to the nearest float16 (ties to even), overflowing to infinity, as numpy's cast;
 * any NaN gives a NaN.  Without branches: a normal float16 is `x` rounded to a multiple of
 * its spacing s by adding and taking away 2^52 * s (whose own spacing is s); a subnormal one
 * is x * 2^24 rounded to an integer the same way. */
static inline uint16_t double_to_half(double x)
{
    uint64_t bits, abs_bits, big_bits, near_bits, tiny_bits;
    memcpy(&bits, &x, sizeof bits);
    abs_bits = bits & 0x7FFFFFFFFFFFFFFFULL;
    double a, big;
    memcpy(&a, &abs_bits, sizeof a);
    big_bits = ((abs_bits >> 52) + 42) << 52; /* 2^52 spacings of a float16 of a's binade */
    memcpy(&big, &big_bits, sizeof big);
    double near = (a + big) - big;
    memcpy(&near_bits, &near, sizeof near_bits);
    uint64_t normal = ((((near_bits >> 52) - (1023 - 15)) << 10) | ((near_bits >> 42) & 0x03FF));
    double tiny = a * 0x1p24 + 0x1p52; /* its last bits: x / 2^-24 rounded to an integer */
    memcpy(&tiny_bits, &tiny, sizeof tiny_bits);
    uint64_t subnormal = tiny_bits & 0x07FF;
    uint64_t is_subnormal = mask_of(abs_bits < 0x3F10000000000000ULL); /* below 2^-14 */
    uint64_t is_infinite = mask_of(abs_bits >= 0x40EFFE0000000000ULL); /* 65520 or more */
    uint64_t is_nan = mask_of(abs_bits > 0x7FF0000000000000ULL);
    uint64_t h = (subnormal & is_subnormal) | (normal & ~is_subnormal);
    h = (0x7C00 & is_infinite) | (h & ~is_infinite);
    h = (0x7E00 & is_nan) | (h & ~is_nan);
    return (uint16_t)(h | ((bits >> 48) & 0x8000));
}

/* the float16 beside `bits` toward -inf (down) or +inf, as numpy.nextafter (not NaN) */
static inline uint16_t neighbour(uint16_t bits, int down)
{
    uint32_t outward = (uint32_t)down == (uint32_t)(bits >> 15);
    uint32_t mag = bits & 0x7FFF;
    uint32_t next = (bits + 2 * outward - 1) & 0xFFFF; /* bits + 1 or bits - 1 */
    uint32_t zero = (uint32_t)mask_of(mag == 0), stays = (uint32_t)mask_of(mag == 0x7C00 && outward);
    uint32_t from_zero = down ? 0x8001 : 0x0001; /* the smallest subnormal of that sign */
    next = (from_zero & zero) | (next & ~zero);
    return (uint16_t)((bits & stays) | (next & ~stays));
}

/* the sum of contiguous float64 values in the order numpy.sum adds them (pairwise: runs of up
 * to 128 values in eight interleaved partial sums, longer runs halved at a multiple of 8), so
 * that the row's summed error is numpy's to the last bit */
static double pairwise_sum(const double *a, Py_ssize_t n)
{
    if (n < 8) {
        double res = 0.;
        for (Py_ssize_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    Py_ssize_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

/* a candidate move: its cost as an ordered integer (cost_key) and its column */
typedef struct {
    uint64_t key;
    Py_ssize_t col;
} Move;

/* the bits of a double as an integer in the double's order (-0.0 taken as 0.0; not NaN) */
static inline uint64_t cost_key(double cost)
{
    uint64_t bits;
    cost += 0.0;
    memcpy(&bits, &cost, sizeof bits);
    /* negative: every bit flipped; else the sign bit set */
    return bits ^ (mask_of(bits >> 63) | 0x8000000000000000ULL);
}

static inline int cheaper(Move a, Move b)
{
    return a.key < b.key || (a.key == b.key && a.col < b.col);
}

static inline void swap(Move *a, Move *b)
{
    Move t = *a;
    *a = *b;
    *b = t;
}

/* Hoare partition of moves[lo..hi] around their median of three; returns (i, j): moves[lo..j]
 * are at most the pivot, moves[i..hi] at least, those between equal to it */
static void partition(Move *moves, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t *pi, Py_ssize_t *pj)
{
    Py_ssize_t mid = lo + (hi - lo) / 2;
    if (cheaper(moves[mid], moves[lo]))
        swap(&moves[mid], &moves[lo]);
    if (cheaper(moves[hi], moves[lo]))
        swap(&moves[hi], &moves[lo]);
    if (cheaper(moves[hi], moves[mid]))
        swap(&moves[hi], &moves[mid]);
    Move pivot = moves[mid];
    Py_ssize_t i = lo, j = hi;
    while (i <= j) {
        while (cheaper(moves[i], pivot))
            i++;
        while (cheaper(pivot, moves[j]))
            j--;
        if (i <= j) {
            swap(&moves[i], &moves[j]);
            i++;
            j--;
        }
    }
    *pi = i;
    *pj = j;
}

static void insertion_sort(Move *moves, Py_ssize_t m)
{
    for (Py_ssize_t i = 1; i < m; i++) {
        Move v = moves[i];
        Py_ssize_t j = i;
        for (; j > 0 && cheaper(v, moves[j - 1]); j--)
            moves[j] = moves[j - 1];
        moves[j] = v;
    }
}

/* the move of float16 `bits` to its other neighbour (toward -inf when `down`), as a double:
 * the spacing of the float16s there, with its direction's sign (exact: numpy's difference of
 * the two values), from the exponent alone.  Infinite out of the largest finite float16; not
 * defined from an infinity (rows holding one are not compensated here). */
static inline double move_step(uint16_t bits, int down)
{
    uint64_t mag = bits & 0x7FFF, e = mag >> 10;
    uint64_t outward = (uint64_t)down == (uint64_t)(bits >> 15);
    /* a power of two moving toward zero lands in the binade below, of half the spacing */
    uint64_t below = (!outward) & ((mag & 0x03FF) == 0) & (e > 1);
    uint64_t exponent = (e > 1 ? e : 1) - below + 1023 - 25;
    uint64_t huge = mask_of(outward & (mag == 0x7BFF));
    uint64_t step = ((exponent << 52) & ~huge) | (0x7FF0000000000000ULL & huge);
    step |= (uint64_t)(down != 0) << 63;
    double v;
    memcpy(&v, &step, sizeof v);
    return v;
}

static inline double move_cost(double resid, double step)
{
    return fabs(resid + step) - fabs(resid);
}

/* the moves taken so far, in order: their summed steps and costs, and the best count */
typedef struct {
    const uint16_t *nearest;
    const double *resid;
    double total, reach_sum, cost_sum, best;
    Py_ssize_t taken, count;
    int down;
} Walk;

/* takes the next move (in cost order); whether the walk may stop: twice the costs taken reach
 * the best objective, and the last cost is not negative (no later one is: the objective only
 * grows from there, so no later count beats the best) */
static inline int take(Walk *w, Move move)
{
    double step = move_step(w->nearest[move.col], w->down);
    double cost = move_cost(w->resid[move.col], step);
    w->reach_sum = w->taken ? w->reach_sum + step : step;
    w->cost_sum = w->taken ? w->cost_sum + cost : cost;
    w->taken++;
    double objective = fabs(w->total + w->reach_sum) + 2.0 * w->cost_sum;
    if (objective < w->best) {
        w->best = objective;
        w->count = w->taken;
    }
    return cost >= 0 && 2.0 * w->cost_sum >= w->best;
}

/* takes moves[0:m] in order of (cost, column) until the walk may stop, sorting only as far as
 * it gets (an incremental quicksort: the lowest part is split until it is small, sorted and
 * taken); moves[0:taken] end up in order.  `ends`: room for 2 * m + 2 segment ends.  1 when
 * the walk stopped. */
static int take_in_order(Move *moves, Py_ssize_t m, Walk *w, Py_ssize_t *ends)
{
    Py_ssize_t lo = 0, top = 0;
    ends[top++] = m;
    while (top) {
        Py_ssize_t end = ends[top - 1];
        if (end - lo <= 16) {
            insertion_sort(moves + lo, end - lo);
            top--;
            for (; lo < end; lo++)
                if (take(w, moves[lo]))
                    return 1;
            continue;
        }
        Py_ssize_t i, j;
        partition(moves, lo, end - 1, &i, &j);
        ends[top++] = i;     /* then those equal to the pivot */
        ends[top++] = j + 1; /* the lower part first */
    }
    return 0;
}

#define NO_MOVE UINT64_MAX
#define SAMPLES 32

/* a cost key below which about 2 * sqrt(n) of the row's moves lie, from a sample of `keys`
 * (NO_MOVE where a value has none; ResNet-50 fp16: a head of 2 to 4 * sqrt(n) runs as fast,
 * of 1 * sqrt(n) 5 % slower) */
static uint64_t head_threshold(const uint64_t *keys, Py_ssize_t n)
{
    uint64_t sample[SAMPLES];
    for (int i = 0; i < SAMPLES; i++) {
        uint64_t v = keys[(Py_ssize_t)((2 * i + 1) * n / (2 * SAMPLES))];
        int j = i;
        for (; j > 0 && sample[j - 1] > v; j--)
            sample[j] = sample[j - 1];
        sample[j] = v;
    }
    Py_ssize_t q = 2 * (Py_ssize_t)sqrt((double)n) * SAMPLES / n;
    return sample[q < SAMPLES - 1 ? q : SAMPLES - 1];
}

/* the moves whose key lies in [lo, hi], in column order; how many */
static Py_ssize_t moves_between(const uint64_t *keys, Py_ssize_t n, uint64_t lo, uint64_t hi,
                                Move *moves)
{
    Py_ssize_t m = 0;
    for (Py_ssize_t j = 0; j < n; j++) { /* without branches: which values move is random */
        moves[m].key = keys[j];
        moves[m].col = j;
        m += (keys[j] >= lo) & (keys[j] <= hi);
    }
    return m;
}

/* its loops over the row's values vectorize with AVX2 (twice as fast): a clone for processors
 * that have it, chosen when the module loads (GCC's target_clones, which needs glibc's ifunc) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* what the compensation of one row of `n` values works in (one allocation, reused row after
 * row); `exact` and `nearest` hold a fold's products and their rounding */
typedef struct {
    double *resid, *exact;
    uint64_t *keys;
    Move *moves;
    Py_ssize_t *ends; /* 2 * n + 2 segment ends (take_in_order) */
    uint16_t *nearest;
} Workspace;

static int workspace_alloc(Workspace *ws, Py_ssize_t n)
{
    size_t count = (size_t)n;
    char *at = malloc(count * (3 * sizeof(double) + sizeof(Move) + sizeof(uint16_t)) +
                      (2 * count + 2) * sizeof(Py_ssize_t));
    if (at == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ws->resid = (double *)at;
    ws->exact = ws->resid + n;
    ws->keys = (uint64_t *)(ws->exact + n);
    ws->moves = (Move *)(ws->keys + n);
    ws->ends = (Py_ssize_t *)(ws->moves + n);
    ws->nearest = (uint16_t *)(ws->ends + 2 * n + 2);
    return 0;
}

static void workspace_free(Workspace *ws)
{
    free(ws->resid);
}

/* one row; 0 when its summed error is not finite (the caller falls back) */
VECTOR_CLONES
static int compensate_row(const double *exact, const uint16_t *nearest, uint16_t *out,
                          Py_ssize_t n, const Workspace *ws)
{
    double *resid = ws->resid;
    uint64_t *keys = ws->keys;
    Move *moves = ws->moves;
    Py_ssize_t *ends = ws->ends;
    for (Py_ssize_t j = 0; j < n; j++)
        resid[j] = half_to_double(nearest[j]) - exact[j];
    double total = pairwise_sum(resid, n);
    if (!isfinite(total))
        return 0;
    memcpy(out, nearest, n * sizeof(uint16_t));
    if (total == 0)
        return 1;
    /* a move helps the sum where its value's error has the sum's sign, toward the exact value:
     * down where both are positive */
    int positive = total > 0, down = positive;
    Py_ssize_t m = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        double r = resid[j];
        double step = move_step(nearest[j], down);
        uint64_t helps = (r != 0) & ((r > 0) == positive) & (fabs(step) <= DBL_MAX);
        keys[j] = cost_key(move_cost(r, step)) | ~mask_of(helps); /* NO_MOVE where not */
        m += helps;
    }
    if (m == 0)
        return 1;
    /* the moves up to a sampled cost come first in the order: taken first, then (when the
     * walk goes on) the others */
    uint64_t t = head_threshold(keys, n);
    t = t == NO_MOVE ? NO_MOVE - 1 : t;
    Walk w = {nearest, resid, total, 0.0, 0.0, fabs(total + 0.0) + 2.0 * 0.0, 0, 0, down};
    Py_ssize_t p = moves_between(keys, n, 0, t, moves);
    if (!take_in_order(moves, p, &w, ends) && p < m)
        take_in_order(moves + p, moves_between(keys, n, t + 1, NO_MOVE - 1, moves + p), &w, ends);
    for (Py_ssize_t j = 0; j < w.count; j++)
        out[moves[j].col] = neighbour(nearest[moves[j].col], down);
    return 1;
}

VECTOR_CLONES
static void widen_values(const uint16_t *h, double *out, Py_ssize_t n)
{
    for (Py_ssize_t j = 0; j < n; j++)
        out[j] = half_to_double(h[j]);
}

/* an argument that is a buffer: its name, item size, whether it is written, whether None is
 * allowed in its place */
typedef struct {
    const char *name;
    Py_ssize_t itemsize;
    int writable, optional;
} BufferArg;

static void release_buffers(Py_buffer *views, int count)
{
    for (int i = 0; i < count; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
}

/* the C-contiguous views of `objs` as `args` describe them (an optional one given as None: no
 * view, obj NULL); -1 with those taken released when one cannot be taken */
static int get_buffers(PyObject *const *objs, const BufferArg *args, int count, Py_buffer *views)
{
    for (int i = 0; i < count; i++) {
        views[i].obj = NULL;
        if (args[i].optional && objs[i] == Py_None)
            continue;
        int flags = PyBUF_C_CONTIGUOUS | (args[i].writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(objs[i], &views[i], flags) < 0) {
            views[i].obj = NULL;
            release_buffers(views, i);
            return -1;
        }
        if (views[i].itemsize != args[i].itemsize) {
            PyErr_Format(PyExc_ValueError, "%s: items of %zd bytes expected", args[i].name,
                         args[i].itemsize);
            release_buffers(views, i + 1);
            return -1;
        }
    }
    return 0;
}

/* a call's arguments: `count` buffers as `spec` describes them, then (when `length` is not
 * NULL) a row length; the views taken into `views` (release_buffers), or -1 with the error */
static int take_args(PyObject *args, const BufferArg *spec, int count, Py_buffer *views,
                     Py_ssize_t *length)
{
    PyObject *objs[8];
    Py_ssize_t given = PyTuple_GET_SIZE(args), expected = count + (length != NULL);
    if (given != expected) {
        PyErr_Format(PyExc_TypeError, "%zd arguments expected, %zd given", expected, given);
        return -1;
    }
    for (int i = 0; i < count; i++)
        objs[i] = PyTuple_GET_ITEM(args, i);
    if (length != NULL) {
        *length = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, count));
        if (*length == -1 && PyErr_Occurred())
            return -1;
    }
    return get_buffers(objs, spec, count, views);
}

/* the number of items of a view */
static Py_ssize_t items(const Py_buffer *view)
{
    return view->len / view->itemsize;
}

/* 0 with a ValueError `message` unless `fits` */
static int require_fit(int fits, const char *message)
{
    if (!fits)
        PyErr_SetString(PyExc_ValueError, message);
    return fits;
}

PyDoc_STRVAR(compensate_doc,
             "compensate(exact, nearest, out, length) -> bool\n\n"
             "Compensated float16 rows of `length` values: `exact` float64, `nearest` its\n"
             "float16 rounding as uint16 bits, `out` the uint16 bits to write (C-contiguous).\n"
             "False (out unspecified) when a row's summed rounding error is not finite.");

static PyObject *compensate(PyObject *self, PyObject *args)
{
    static const BufferArg spec[3] = {{"exact", 8, 0, 0}, {"nearest", 2, 0, 0}, {"out", 2, 1, 0}};
    Py_buffer v[3];
    Py_ssize_t n;
    if (take_args(args, spec, 3, v, &n) < 0)
        return NULL;
    Py_ssize_t values = items(&v[0]);
    int ok = require_fit(n > 0 && values % n == 0 && items(&v[1]) == values &&
                             items(&v[2]) == values,
                         "compensate: buffers of whole rows of equal size");
    Workspace ws;
    if (ok && workspace_alloc(&ws, n) < 0)
        ok = 0;
    PyObject *result = NULL;
    if (ok) {
        const double *e = v[0].buf;
        const uint16_t *h = v[1].buf;
        uint16_t *o = v[2].buf;
        int done = 1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < values && done; i += n)
            done = compensate_row(e + i, h + i, o + i, n, &ws);
        Py_END_ALLOW_THREADS
        workspace_free(&ws);
        result = PyBool_FromLong(done);
    }
    release_buffers(v, 3);
    return result;
}

/* onnxruntime's fold of a row: each float16 weight times the float32 scale, rounded once to
 * float16, as float64 (the portable loop; see their_fold_f16c) */
static void their_fold(const uint16_t *w, float s, Py_ssize_t n, double *theirs)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        float product = (float)half_to_double(w[j]) * s;
        theirs[j] = half_to_double(double_to_half((double)product));
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define F16C_FOLD 1
/* their_fold with the processor's float16 conversions (F16C: exact widening, rounding to
 * nearest even), eight values at a time: 4x faster */
__attribute__((target("avx2,f16c"))) static void their_fold_f16c(const uint16_t *w, float s,
                                                                   Py_ssize_t n, double *theirs)
{
    __m256 scale = _mm256_set1_ps(s);
    Py_ssize_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + j)));
        __m128i rounded = _mm256_cvtps_ph(_mm256_mul_ps(wide, scale), _MM_FROUND_TO_NEAREST_INT);
        __m256 back = _mm256_cvtph_ps(rounded);
        _mm256_storeu_pd(theirs + j, _mm256_cvtps_pd(_mm256_castps256_ps128(back)));
        _mm256_storeu_pd(theirs + j + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(back, 1)));
    }
    their_fold(w + j, s, n - j, theirs + j);
}

/* whether the processor has F16C and AVX2 (set when the module loads) */
static int has_f16c = 0;
#endif

/* one row of a float16 Conv fold (fold_block): the weights widened, scaled by `s`, rounded to
 * nearest and compensated; onnxruntime's fold of them with `their_s` (float32 product, rounded
 * once) when `theirs` is given; the non-zero products and those that round to zero counted */
VECTOR_CLONES
static int fold_row(const uint16_t *w, double s, int has_theirs, float their_s, Py_ssize_t n,
                    double *wide, uint16_t *out, double *folded, double *theirs,
                    const Workspace *ws, Py_ssize_t *nonzero, Py_ssize_t *flushed)
{
    double *exact = ws->exact;
    uint16_t *nearest = ws->nearest;
    Py_ssize_t nz = 0, fl = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        wide[j] = half_to_double(w[j]);
        exact[j] = wide[j] * s;
        nearest[j] = double_to_half(exact[j]);
        uint64_t product_nonzero = exact[j] != 0;
        nz += product_nonzero;
        fl += product_nonzero & ((nearest[j] & 0x7FFF) == 0);
    }
    *nonzero += nz;
    *flushed += fl;
    if (!compensate_row(exact, nearest, out, n, ws))
        return 0;
    for (Py_ssize_t j = 0; j < n; j++)
        folded[j] = half_to_double(out[j]);
    if (has_theirs) {
#ifdef F16C_FOLD
        if (has_f16c)
            their_fold_f16c(w, their_s, n, theirs);
        else
#endif
            their_fold(w, their_s, n, theirs);
    }
    return 1;
}

PyDoc_STRVAR(fold_block_doc,
             "fold_block(weights, scale, their_scale, out, wide, folded, theirs, length)\n"
             "    -> (ok, nonzero, flushed)\n\n"
             "Rows of `length` float16 weights (uint16 bits) folded by a float64 scale per row:\n"
             "`wide` gets them as float64, `out` (uint16) their compensated rounding and `folded`\n"
             "that as float64; with a float32 `their_scale` (else None), `theirs` gets\n"
             "onnxruntime's own fold as float64.  ok is False (outputs unspecified) when a row's\n"
             "summed rounding error is not finite.");

static PyObject *fold_block(PyObject *self, PyObject *args)
{
    static const BufferArg spec[7] = {
        {"weights", 2, 0, 0}, {"scale", 8, 0, 0},  {"their_scale", 4, 0, 1}, {"out", 2, 1, 0},
        {"wide", 8, 1, 0},    {"folded", 8, 1, 0}, {"theirs", 8, 1, 1},
    };
    Py_buffer v[7];
    Py_ssize_t n;
    if (take_args(args, spec, 7, v, &n) < 0)
        return NULL;
    int has_theirs = v[2].obj != NULL;
    if (!require_fit(has_theirs == (v[6].obj != NULL),
                     "fold_block: their_scale and theirs both or neither")) {
        release_buffers(v, 7);
        return NULL;
    }
    Py_ssize_t values = items(&v[0]), rows = n > 0 ? values / n : 0;
    int fits = n > 0 && values % n == 0 && items(&v[1]) == rows;
    for (int i = 3; i < 7; i++)
        fits &= v[i].obj == NULL || items(&v[i]) == values;
    fits &= !has_theirs || items(&v[2]) == rows;
    int ok = require_fit(fits, "fold_block: buffers of whole rows of equal size");
    Workspace ws;
    if (ok && workspace_alloc(&ws, n) < 0)
        ok = 0;
    PyObject *result = NULL;
    if (ok) {
        const uint16_t *w = v[0].buf;
        const double *scale = v[1].buf;
        const float *their_scale = has_theirs ? v[2].buf : NULL;
        uint16_t *out = v[3].buf;
        double *wide = v[4].buf, *folded = v[5].buf;
        double *theirs = has_theirs ? v[6].buf : NULL;
        Py_ssize_t nonzero = 0, flushed = 0;
        int done = 1;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t r = 0; r < rows && done; r++) {
            Py_ssize_t at = r * n;
            done = fold_row(w + at, scale[r], has_theirs, has_theirs ? their_scale[r] : 0.0f, n,
                            wide + at, out + at, folded + at, has_theirs ? theirs + at : NULL,
                            &ws, &nonzero, &flushed);
        }
        Py_END_ALLOW_THREADS
        workspace_free(&ws);
        result = Py_BuildValue("Onn", done ? Py_True : Py_False, nonzero, flushed);
    }
    release_buffers(v, 7);
    return result;
}

VECTOR_CLONES
static void largest_magnitudes(const uint16_t *h, Py_ssize_t rows, Py_ssize_t n, uint16_t *out)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        uint16_t top = 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            uint16_t mag = h[r * n + j] & 0x7FFF;
            top = mag > top ? mag : top;
        }
        out[r] = top;
    }
}

PyDoc_STRVAR(largest_doc,
             "largest(bits, out, length) -> None\n\n"
             "Each row's largest float16 magnitude (the bits without the sign, ordered like the\n"
             "magnitudes; NaNs above infinity) of rows of `length` uint16 bits, into `out`.");

static PyObject *largest(PyObject *self, PyObject *args)
{
    static const BufferArg spec[2] = {{"bits", 2, 0, 0}, {"out", 2, 1, 0}};
    Py_buffer v[2];
    Py_ssize_t n;
    if (take_args(args, spec, 2, v, &n) < 0)
        return NULL;
    Py_ssize_t values = items(&v[0]);
    int ok = require_fit(n > 0 && values % n == 0 && items(&v[1]) == values / n,
                         "largest: whole rows in, one value per row out");
    if (ok) {
        const uint16_t *h = v[0].buf;
        uint16_t *o = v[1].buf;
        Py_BEGIN_ALLOW_THREADS
        largest_magnitudes(h, values / n, n, o);
        Py_END_ALLOW_THREADS
    }
    release_buffers(v, 2);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* rows of float32 weights times a float64 scale per row, rounded to float32 (numpy's
 * w.astype(float64) * scale, then .astype(float32)); stats[0..1]: the products' largest and
 * smallest (NaN if any is NaN), counts[0..1]: the non-zero products and those stored as zero */
VECTOR_CLONES
static void scale_float32_rows(const float *w, const double *scale, Py_ssize_t rows,
                               Py_ssize_t n, float *out, double *stats, Py_ssize_t *counts)
{
    double hi = -INFINITY, lo = INFINITY;
    Py_ssize_t nonzero = 0, flushed = 0, nan = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        double s = scale[r];
        for (Py_ssize_t j = r * n; j < (r + 1) * n; j++) {
            double exact = (double)w[j] * s;
            float stored = (float)exact;
            hi = exact > hi ? exact : hi;
            lo = exact < lo ? exact : lo;
            nan += exact != exact;
            Py_ssize_t product_nonzero = exact != 0;
            nonzero += product_nonzero;
            flushed += product_nonzero & (stored == 0);
            out[j] = stored;
        }
    }
    stats[0] = nan ? NAN : hi;
    stats[1] = nan ? NAN : lo;
    counts[0] = nonzero;
    counts[1] = flushed;
}

PyDoc_STRVAR(scale_rows_doc,
             "scale_rows(weights, scale, out, length) -> (largest, smallest, nonzero, flushed)\n\n"
             "Rows of `length` float32 weights times a float64 scale per row, rounded to float32\n"
             "into `out`: the products' largest and smallest value (NaN if any is NaN), how many\n"
             "are not zero and how many of those round to zero.");

static PyObject *scale_rows(PyObject *self, PyObject *args)
{
    static const BufferArg spec[3] = {{"weights", 4, 0, 0}, {"scale", 8, 0, 0}, {"out", 4, 1, 0}};
    Py_buffer v[3];
    Py_ssize_t n;
    if (take_args(args, spec, 3, v, &n) < 0)
        return NULL;
    Py_ssize_t values = items(&v[0]);
    int ok = require_fit(n > 0 && values % n == 0 && items(&v[1]) == values / n &&
                             items(&v[2]) == values,
                         "scale_rows: whole rows, a scale per row");
    double stats[2] = {0, 0};
    Py_ssize_t counts[2] = {0, 0};
    if (ok) {
        const float *weights = v[0].buf;
        const double *scale = v[1].buf;
        float *out = v[2].buf;
        Py_BEGIN_ALLOW_THREADS
        scale_float32_rows(weights, scale, values / n, n, out, stats, counts);
        Py_END_ALLOW_THREADS
    }
    release_buffers(v, 3);
    if (!ok)
        return NULL;
    return Py_BuildValue("ddnn", stats[0], stats[1], counts[0], counts[1]);
}

PyDoc_STRVAR(widen_doc,
             "widen(bits, out) -> None\n\n"
             "float16 values (uint16 bits) as float64 into `out`, exactly.");

static PyObject *widen(PyObject *self, PyObject *args)
{
    static const BufferArg spec[2] = {{"bits", 2, 0, 0}, {"out", 8, 1, 0}};
    Py_buffer v[2];
    if (take_args(args, spec, 2, v, NULL) < 0)
        return NULL;
    Py_ssize_t values = items(&v[0]);
    int ok = require_fit(items(&v[1]) == values, "widen: as many values out as in");
    if (ok) {
        const uint16_t *h = v[0].buf;
        double *o = v[1].buf;
        Py_BEGIN_ALLOW_THREADS
        widen_values(h, o, values);
        Py_END_ALLOW_THREADS
    }
    release_buffers(v, 2);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"compensate", compensate, METH_VARARGS, compensate_doc},
    {"fold_block", fold_block, METH_VARARGS, fold_block_doc},
    {"widen", widen, METH_VARARGS, widen_doc},
    {"largest", largest, METH_VARARGS, largest_doc},
    {"scale_rows", scale_rows, METH_VARARGS, scale_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rounding", "float16 Conv folds: compensated rounding, natively.", -1, methods,
};

PyMODINIT_FUNC PyInit__rounding(void)
{
#ifdef F16C_FOLD
    __builtin_cpu_init();
    has_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
