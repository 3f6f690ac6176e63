/* One decoder layer of the Llama family (or Gemma 3's) in one call, from the kernels of gemm.c,
 * layer.c, attention.c:
 *
 *   h = rmsnorm(x) -> qkv = h Wqkv (+b) -> [rmsnorm each q, k head] -> rope q, k; k, v into the cache
 *   -> a = attention(q) -> x += [rmsnorm](a Wo (+b)) -> h = rmsnorm(x) -> g = h Wgu (+b)
 *   -> m = act(g) * u -> x += [rmsnorm](m Wd (+b))
 *
 * The bracketed norms are Gemma 3's (present when their weights are); act is silu or gelu (tanh).
 * The residual stream x [T, hidden] is updated in place. The same arithmetic as calling each kernel
 * from Python, without a Python round trip per operation (which costs more than a decode step's
 * elementwise work). Weights are packed panels (gemm.c) or quantized blocks (quant.c); activations
 * float32 or bfloat16 (float32 with quantized weights).
 */
#include <stdint.h>

#include "kernels.h"

/* Per-layer constants, set once at load. Pointers: weights, optional biases (NULL: none). A weight is
 * a packed float panel set (gemm.c) when its format is -1, else a kquant.c linear layer (its own
 * segments and biases; float32 activations only), for qkv, o, gate_up, down in that order. The
 * q/k head norms and the norms after attention and MLP are NULL where the model has none; act: 0 silu,
 * 1 gelu (tanh); local_rope: 1 where the layer turns with the step's second RoPE table; rope_dim: the
 * leading values of each q and k head that turn (head_dim but for partial RoPE). */
typedef struct {
    const void *ln1, *qkv, *qkv_bias, *o, *o_bias, *ln2, *gate_up, *gate_up_bias, *down, *down_bias;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, window;
    float eps, scale;
    int64_t format[4];
    const void *q_norm, *k_norm, *post_attn_norm, *post_mlp_norm;
    int64_t act, local_rope, rope_dim;
} layer_t;

/* Per-step inputs shared by every layer: RoPE tables, cache slots and the attention plan. */
typedef struct {
    int64_t T;
    const float *cos, *sin;
    const int64_t *slots, *tables, *rows, *ctx_lens, *tokens, *tile_start;
    int64_t max_blocks, tiles, block_size, num_threads;
    int is_bf16;
    const float *cos_local, *sin_local;   /* the second RoPE table (Gemma 3's sliding layers), or NULL */
    int64_t kv_fmt;                       /* the cache's element format (half.h) */
    const int64_t *positions;             /* NULL: cos, sin hold the step's T rows; else tables of */
    int64_t rope_rows;                    /* rope_rows rows, token t turning with row positions[t] */
} step_t;

/* y = x W^T (+ bias) (+ res). A quantized weight has no residual epilogue: its product goes to tmp
 * [T, N] first, then is added, as an unfused add would. */
static int linear(const step_t *s, int64_t format, const void *x, int64_t ldx, const void *w, const void *bias,
                  const void *res, void *y, int64_t N, int64_t K, float *tmp) {
    if (format >= 0) {
        if (s->is_bf16) return -1;
        float *out = res ? tmp : (float *)y;
        (void)bias;   /* a quantized layer carries its biases with its segments */
        const int status = kq_linear(x, ldx, w, out, N, s->T, s->num_threads);
        if (res)
            for (int64_t i = 0; i < s->T * N; i++) ((float *)y)[i] = ((const float *)res)[i] + out[i];
        return status;
    }
    if (s->is_bf16)
        return gemm_bf16(x, ldx, w, bias, res, N, y, N, s->T, N, K, s->num_threads);
    return gemm_f32(x, ldx, w, bias, res, N, y, N, s->T, N, K, s->num_threads);
}

/* out = [rmsnorm](a W (+b)), then x += out: the residual after a norm (Gemma 3), or in the matmul's
 * epilogue where there is none. */
static int project_residual(const step_t *s, const layer_t *l, int64_t format, const void *a, int64_t lda,
                            const void *w, const void *bias, const void *norm, void *x, int64_t K, char *tmp) {
    const int64_t hidden = l->hidden;
    if (!norm) return linear(s, format, a, lda, w, bias, x, x, hidden, K, (float *)tmp);
    const int status = linear(s, format, a, lda, w, bias, 0, tmp, hidden, K, 0);
    rmsnorm(tmp, hidden, norm, tmp, hidden, s->T, hidden, l->eps, s->is_bf16, s->num_threads);
    add_rows(x, tmp, s->T * hidden, s->is_bf16);
    return status;
}

/* scratch: T * (hidden + qkv width + q width + 2 * intermediate + intermediate) elements of the dtype. */
int decoder_layer(void *x, const layer_t *l, const step_t *s, void *k_cache, void *v_cache, void *scratch) {
    const int64_t T = s->T, E = s->is_bf16 ? 2 : 4, hidden = l->hidden, D = l->head_dim;
    const int64_t q_width = l->heads * D, qkv_width = (l->heads + 2 * l->kv_heads) * D, I = l->intermediate;
    char *h = scratch, *qkv = h + T * hidden * E, *attn = qkv + T * qkv_width * E;
    char *gate_up = attn + T * q_width * E, *act = gate_up + T * 2 * I * E;
    const float *cos = l->local_rope ? s->cos_local : s->cos, *sin = l->local_rope ? s->sin_local : s->sin;
    if (!cos || !sin) return -1;
    int status = 0;
    rmsnorm(x, hidden, l->ln1, h, hidden, T, hidden, l->eps, s->is_bf16, s->num_threads);
    status |= linear(s, l->format[0], h, hidden, l->qkv, l->qkv_bias, 0, qkv, qkv_width, hidden, 0);
    status |= rope_cache(qkv, qkv_width, T, l->heads, l->kv_heads, D, l->rope_dim, cos, sin, s->positions,
                         s->rope_rows, s->slots, k_cache, v_cache, s->block_size, l->q_norm, l->k_norm, l->eps,
                         s->is_bf16, (int)s->kv_fmt, s->num_threads);
    status |= paged_attention(qkv, qkv_width, k_cache, v_cache, s->tables, s->max_blocks, s->rows, s->ctx_lens,
                              s->tokens, s->tile_start, s->tiles, l->heads, l->kv_heads, D, s->block_size,
                              l->window, l->scale, attn, q_width, s->num_threads, s->is_bf16, (int)s->kv_fmt);
    status |= project_residual(s, l, l->format[1], attn, q_width, l->o, l->o_bias, l->post_attn_norm, x, q_width, h);
    rmsnorm(x, hidden, l->ln2, h, hidden, T, hidden, l->eps, s->is_bf16, s->num_threads);
    status |= linear(s, l->format[2], h, hidden, l->gate_up, l->gate_up_bias, 0, gate_up, 2 * I, hidden, 0);
    gated_act(gate_up, 2 * I, act, I, T, I, l->act, s->is_bf16, s->num_threads);
    status |= project_residual(s, l, l->format[3], act, I, l->down, l->down_bias, l->post_mlp_norm, x, I, h);
    return status ? -1 : 0;
}

/* Layers [0, n) in turn, each as decoder_layer: a step's layers in one call from Python, not one per layer. */
int decoder_layers(void *x, const layer_t *const *layers, int64_t n, const step_t *s, void *const *k_caches,
                   void *const *v_caches, void *scratch) {
    /* RoPE rows looked up by position: checked before anything is written (a layer's kernels each check their
     * own inputs, but a refusal inside one lets the layer's other parts run on) */
    for (int64_t t = 0; s->positions && t < s->T; t++)
        if (s->positions[t] < 0 || s->positions[t] >= s->rope_rows) return -1;
    for (int64_t i = 0; i < n; i++)
        if (decoder_layer(x, layers[i], s, k_caches[i], v_caches[i], scratch) != 0) return -1;
    return 0;
}

/* The model's head: the final RMSNorm and the output layer (format as layer_t's: -1 packed floats, else
 * a kquant.c linear layer carrying its own biases). */
typedef struct {
    const void *norm, *weight, *bias;
    int64_t format, hidden, vocab;
    float eps;
} head_t;

/* Every layer, then the head over the step's rows to score (rows[i] of x): logits [n_rows, vocab] in the
 * activations' dtype (float32 for a quantized head). The kernels a call of each from Python runs, with the
 * same rows and threads: the same bits, without the round trip through Python between them, which after
 * a step's weights have streamed through the caches costs as much as a small matmul. */
int decoder_step(void *x, const layer_t *const *layers, int64_t n, const step_t *s, void *const *k_caches,
                 void *const *v_caches, void *scratch, const head_t *head, const int64_t *rows, int64_t n_rows,
                 void *logits) {
    if (n_rows < 0 || n_rows > s->T) return -1;
    for (int64_t i = 0; i < n_rows; i++)   /* checked before anything is written */
        if (rows[i] < 0 || rows[i] >= s->T) return -1;
    if (decoder_layers(x, layers, n, s, k_caches, v_caches, scratch) != 0) return -1;
    if (n_rows == 0) return 0;
    const int64_t hidden = head->hidden, E = s->is_bf16 ? 2 : 4;
    for (int64_t i = 0; i < n_rows; i++) {   /* scratch holds T rows of hidden: the layers are done with it */
        rmsnorm((const char *)x + rows[i] * hidden * E, hidden, head->norm, (char *)scratch + i * hidden * E, hidden,
                1, hidden, head->eps, s->is_bf16, s->num_threads);
    }
    step_t scored = *s;
    scored.T = n_rows;
    return linear(&scored, head->format, scratch, hidden, head->weight, head->bias, 0, logits, head->vocab, hidden, 0);
}

/* sizeof(layer_t) (which 0), sizeof(step_t) (1) and sizeof(head_t) (2): Python builds them as
 * decoder.LayerParams, StepParams and HeadParams, and checks their sizes at load. */
int64_t decoder_struct_bytes(int which) {
    return which == 2 ? (int64_t)sizeof(head_t) : which ? (int64_t)sizeof(step_t) : (int64_t)sizeof(layer_t);
}
