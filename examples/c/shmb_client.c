/* shmb_client: a shmbroker client in C, written against docs/PROTOCOL.md alone.
 *
 *   shmb_client MODEL INPUT.f32            prints one line per row: the model's first output, "%.9g" each
 *   shmb_client --inline MODEL INPUT.f32   the same through `shmbroker inline`: tensors in frames, no shm
 *   shmb_client [--inline] MODEL A.jpg B.png ...   a model of images (input kind "image"): one row per file
 *   shmb_client --load SECONDS SLOTS MODEL A.jpg ...   every slot of a session busy with one image a request;
 *                                                    one JSON line: requests, per_s, its CPU a request, p50/p99
 *
 * INPUT.f32 is raw little-endian float32, C order, whole rows of the model's first input (nsfw: N x 224 x
 * 224 x 3). Image files go as they are, in one request: the §4.6 row table and the files' bytes in the slot, or
 * one frame per image inline (§10); the worker decodes them. One session with one slot: HELLO -> SETUP -> the ring's descriptor from rings.sock (SCM_RIGHTS),
 * mmap, flock LOCK_SH ->
 * ATTACHED -> READY -> link the worker (PULL + monitor, PUSH) -> write the slot (inputs, header, state word
 * last) -> SUBMIT -> DONE -> read the outputs in place -> BYE. Exit status: 0 ok, 1 usage or local error,
 * 2 the broker refused (ERROR), 3 the request failed (its status and text are printed to stderr).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>
#include <zmq.h>

#include "minijson.h"

enum { PROTOCOL = 2 };
enum { HELLO = 1, SETUP = 2, ATTACHED = 3, READY = 4, BYE = 5, ERROR_KIND = 12, SUBMIT = 32, DONE = 33 };
enum { RING_REQUEST = 50, RING_GRANT = 51 }; /* §3.2, on rings.sock */
enum { SUBMITTED = 1 };
enum { INLINE_REQUEST = 40, INLINE_REPLY = 41, INLINE_MODELS = 42, INLINE_MODELS_REPLY = 43 }; /* §10 */
#define HEADER_BYTES 4096u
#define SLOT_HEADER_BYTES 256u
#define WAIT_MS 30000

typedef struct { uint32_t session_id, n_requests, n_tensors, flags; uint64_t token; } submit_hdr_t;
typedef struct { uint64_t request_id; uint32_t slot, generation, model_id, first_tensor, n_tensors, timeout_us; } request_rec_t;
typedef struct { uint16_t index; uint8_t dtype, ndim; uint32_t reserved; uint64_t offset, nbytes; int64_t dims[8]; } tensor_desc_t;
typedef struct { uint32_t session_id, n_results, n_tensors, text_bytes; } done_hdr_t;
typedef struct { uint64_t request_id; uint32_t slot, generation, status, first_tensor, n_tensors, msg_offset, msg_len, reserved; } result_rec_t;
_Static_assert(sizeof(submit_hdr_t) == 24 && sizeof(request_rec_t) == 32 && sizeof(tensor_desc_t) == 88, "layout");
_Static_assert(sizeof(done_hdr_t) == 16 && sizeof(result_rec_t) == 40 && offsetof(tensor_desc_t, dims) == 24, "layout");

static void die(int code, const char *what) {
    fprintf(stderr, "shmb_client: %s\n", what);
    exit(code);
}

static uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

/* §1.1: the runtime directory, as the Python client resolves it */
static void runtime_dir(char *out, size_t cap) {
    const char *env = getenv("SHMBROKER_RUNTIME_DIR"), *xdg = getenv("XDG_RUNTIME_DIR"), *tmp = getenv("TMPDIR");
    struct stat st;
    if (env && *env) snprintf(out, cap, "%s", env);
    else if (stat("/run/shmbroker", &st) == 0 && S_ISDIR(st.st_mode) && access("/run/shmbroker", X_OK) == 0)
        snprintf(out, cap, "/run/shmbroker");
    else if (xdg && *xdg && stat(xdg, &st) == 0 && S_ISDIR(st.st_mode) && access(xdg, W_OK) == 0)
        snprintf(out, cap, "%s/shmbroker", xdg);
    else snprintf(out, cap, "%s/shmbroker-%u", tmp && *tmp ? tmp : "/tmp", (unsigned)getuid());
}

/* §2: every message is two frames, <u16 version, u16 kind> and the body */
static void send2(void *sock, int kind, const void *body, size_t len) {
    uint8_t env[4] = {PROTOCOL, 0, (uint8_t)kind, (uint8_t)(kind >> 8)};
    if (zmq_send(sock, env, 4, ZMQ_SNDMORE) != 4 || zmq_send(sock, body, len, 0) != (int)len) die(1, "zmq_send failed");
}

/* Receive one two-frame message within WAIT_MS; returns its kind, the body in *body (zmq_msg owned by caller). */
static int recv2(void *sock, zmq_msg_t *body) {
    zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, WAIT_MS) <= 0) die(1, "no answer within 30 s (is `shmbroker serve` running?)");
    zmq_msg_t env;
    zmq_msg_init(&env);
    zmq_msg_init(body);
    if (zmq_msg_recv(&env, sock, 0) < 0 || !zmq_msg_more(&env) || zmq_msg_recv(body, sock, 0) < 0 || zmq_msg_more(body)
        || zmq_msg_size(&env) != 4)
        die(1, "malformed message: expected exactly 2 frames, the first 4 bytes");
    const uint8_t *e = zmq_msg_data(&env);
    int kind = e[2] | e[3] << 8;
    if ((e[0] | e[1] << 8) != PROTOCOL) die(1, "protocol version of the answer is not 2");
    zmq_msg_close(&env);
    return kind;
}

/* Parse a JSON control body; an ERROR body ends the program with its code and message. */
static void parse_or_fail(js_doc *d, zmq_msg_t *body, int kind, int want) {
    if (js_parse(d, zmq_msg_data(body), zmq_msg_size(body)) != 0) die(1, "unparsable JSON body");
    if (kind == ERROR_KIND) {
        fprintf(stderr, "shmb_client: broker refused: %s: %s\n", js_str(d, js_get(d, 0, "code")),
                js_str(d, js_get(d, 0, "message")));
        exit(2);
    }
    if (kind != want) die(1, "unexpected message kind during the handshake");
}

typedef struct {
    uint32_t session_id, n_slots;
    uint64_t bytes, stride, in_cap, out_cap, out_offset, token;
    uint8_t *base;
    int fd;
} session_t;

/* §3.2: one SOCK_SEQPACKET exchange on rings.sock; RING_GRANT carries the segment's descriptor (SCM_RIGHTS).
   A full backlog makes connect wait for room (SO_SNDTIMEO); a connection closed unanswered is asked again. */
static int fetch_ring(const char *dir, uint32_t session_id, uint64_t token) {
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(sa.sun_path, sizeof sa.sun_path, "%s/rings.sock", dir) >= sizeof sa.sun_path)
        die(1, "the runtime directory's path is too long for a unix socket");
    uint8_t req[16];
    uint16_t head[2] = {RING_REQUEST, PROTOCOL}; /* kind, protocol version (little-endian hosts) */
    memcpy(req, head, 4);
    memcpy(req + 4, &session_id, 4);
    memcpy(req + 8, &token, 8);
    uint8_t grant[12];
    char cbuf[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {grant, sizeof grant};
    struct msghdr mh;
    ssize_t got = 0;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left_ms = WAIT_MS - (now.tv_sec - start.tv_sec) * 1000 - (now.tv_nsec - start.tv_nsec) / 1000000;
        if (left_ms <= 0) die(1, "no RING_GRANT from rings.sock within 30 s (the handout is busy or stuck)");
        struct timeval tv = {left_ms / 1000, (left_ms % 1000) * 1000};
        int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (sock < 0) die(1, "cannot create a socket for rings.sock");
        setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (connect(sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
            if (errno == EAGAIN) { close(sock); continue; } /* the time left ran out; checked above */
            die(1, "cannot connect to rings.sock");
        }
        mh = (struct msghdr){.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        got = send(sock, req, sizeof req, MSG_NOSIGNAL) == (ssize_t)sizeof req ? recvmsg(sock, &mh, MSG_CMSG_CLOEXEC) : 0;
        close(sock);
        if (got > 0) break;
        if (got < 0 && errno != EAGAIN && errno != ECONNRESET) die(1, "cannot receive RING_GRANT");
    }
    uint16_t kind_status[2];
    memcpy(kind_status, grant, 4);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    if (got != (ssize_t)sizeof grant || kind_status[0] != RING_GRANT) die(1, "no RING_GRANT from rings.sock");
    if (kind_status[1] != 0 || !c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
        fprintf(stderr, "shmb_client: the broker refused the ring: status %u\n", kind_status[1]);
        exit(2);
    }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* §3.1 step 3: check SETUP's layout, get and map the segment, verify its header, take the liveness lock */
static void map_segment(session_t *s, const js_doc *d, const char *dir) {
    s->session_id = (uint32_t)js_int(d, js_get(d, 0, "session_id"), 0);
    s->token = js_uint(d, js_get(d, 0, "token"));
    s->n_slots = (uint32_t)js_int(d, js_get(d, 0, "n_slots"), 0);
    s->bytes = (uint64_t)js_int(d, js_get(d, 0, "segment_bytes"), 0);
    s->stride = (uint64_t)js_int(d, js_get(d, 0, "slot_stride"), 0);
    s->in_cap = (uint64_t)js_int(d, js_get(d, 0, "in_capacity"), 0);
    s->out_cap = (uint64_t)js_int(d, js_get(d, 0, "out_capacity"), 0);
    s->out_offset = SLOT_HEADER_BYTES + align_up(s->in_cap, 256);
    if (align_up(s->out_offset + s->out_cap, 4096) != s->stride || HEADER_BYTES + s->n_slots * s->stride != s->bytes)
        die(1, "BAD_LAYOUT: SETUP's slot_stride or segment_bytes disagree with §4");
    struct stat st;
    s->fd = fetch_ring(dir, s->session_id, s->token);
    int seals = fcntl(s->fd, F_GET_SEALS);
    if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
        die(1, "the segment is not sealed against resizing");
    if (fstat(s->fd, &st) != 0 || (uint64_t)st.st_size != s->bytes) die(1, "the segment's size is not SETUP's");
    s->base = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    if (s->base == MAP_FAILED) die(1, "mmap of the segment failed");
    uint32_t u32[4];
    uint64_t u64[5];
    memcpy(u32, s->base + 8, 16);  /* layout_version, header_bytes, session_id, n_slots */
    memcpy(u64, s->base + 24, 40); /* slot_stride, slot_header_bytes, in_capacity, out_capacity, total_bytes */
    if (memcmp(s->base, "SHMBRNG1", 8) || u32[0] != 1 || u32[1] != HEADER_BYTES || u32[2] != s->session_id
        || u32[3] != s->n_slots || u64[0] != s->stride || u64[1] != SLOT_HEADER_BYTES || u64[2] != s->in_cap
        || u64[3] != s->out_cap || u64[4] != s->bytes)
        die(1, "the segment header does not match SETUP");
    if (flock(s->fd, LOCK_SH) != 0) die(1, "flock(LOCK_SH) on the segment failed");
}

/* §3.1 step 6: PULL with a monitor (connected before the PULL connects), PUSH; wait for the handshake event */
static void link_worker(void *ctx, const char *endpoint, const char *reply, void **push, void **pull) {
    int zero = 0;
    *pull = zmq_socket(ctx, ZMQ_PULL);
    zmq_setsockopt(*pull, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(*pull, ZMQ_RCVHWM, &zero, sizeof zero);
    if (zmq_socket_monitor(*pull, "inproc://mon-0", ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) die(1, "monitor failed");
    void *mon = zmq_socket(ctx, ZMQ_PAIR);
    zmq_connect(mon, "inproc://mon-0");
    if (zmq_connect(*pull, reply) != 0) die(1, "connect to the reply endpoint failed");
    *push = zmq_socket(ctx, ZMQ_PUSH);
    zmq_setsockopt(*push, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(*push, ZMQ_SNDHWM, &zero, sizeof zero);
    if (zmq_connect(*push, endpoint) != 0) die(1, "connect to the worker endpoint failed");
    for (;;) {
        zmq_msg_t ev;
        zmq_pollitem_t item = {mon, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, WAIT_MS) <= 0) die(1, "the reply connection did not come up");
        zmq_msg_init(&ev);
        zmq_msg_recv(&ev, mon, 0);
        uint16_t event = 0;
        if (zmq_msg_size(&ev) == 6) memcpy(&event, zmq_msg_data(&ev), 2);
        int more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        while (more) { /* frame 1: the endpoint */
            zmq_msg_init(&ev);
            zmq_msg_recv(&ev, mon, 0);
            more = zmq_msg_more(&ev);
            zmq_msg_close(&ev);
        }
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) break;
    }
    zmq_socket_monitor(*pull, NULL, 0);
    zmq_close(mon);
}

static void *read_input(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) die(1, "cannot open the input file");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc(n > 0 ? (size_t)n : 1);
    if (!buf || n <= 0 || fread(buf, 1, (size_t)n, f) != (size_t)n) die(1, "cannot read the input file");
    fclose(f);
    *len = (size_t)n;
    return buf;
}

/* The model's id and its first input's item shape (one input: float32, or encoded images) from SETUP.models;
   *image: 1 when the input's kind is "image" (§2.2: dtype uint8, shape [-1], one encoded image a row) */
static uint32_t find_model(const js_doc *d, const char *model, int64_t *dims, uint8_t *ndim, const char **in_name,
                           int *image) {
    int models = js_get(d, 0, "models");
    for (int k = 0; js_at(d, models, k) >= 0; k++) {
        int m = js_at(d, models, k);
        if (strcmp(js_str(d, js_get(d, m, "name")), model) != 0) continue;
        int inputs = js_get(d, m, "inputs");
        int in0 = js_at(d, inputs, 0);
        *image = strcmp(js_str(d, js_get(d, in0, "kind")), "image") == 0;
        if (d->nodes[inputs].size != 1 || (!*image && strcmp(js_str(d, js_get(d, in0, "dtype")), "float32") != 0))
            die(1, "this example handles models with one float32 input, or one input of images");
        *in_name = js_str(d, js_get(d, in0, "name"));
        int shape = js_get(d, in0, "shape");
        *ndim = (uint8_t)d->nodes[shape].size;
        for (int i = 0; i < *ndim && i < 8; i++) dims[i] = js_int(d, js_at(d, shape, i), 0);
        return (uint32_t)js_int(d, js_get(d, m, "model_id"), 0);
    }
    die(1, "the broker does not serve that model");
    return 0;
}

/* §5.2: find our result in a DONE, print the first output's rows; returns 1 when it was ours */
static int handle_done(const session_t *s, zmq_msg_t *body) {
    const uint8_t *b = zmq_msg_data(body);
    size_t len = zmq_msg_size(body);
    done_hdr_t h;
    if (len < sizeof h) return 0;
    memcpy(&h, b, sizeof h);
    uint64_t text_at = 16 + 40 * (uint64_t)h.n_results + 88 * (uint64_t)h.n_tensors;
    if (text_at + h.text_bytes != len) return 0;
    for (uint32_t i = 0; i < h.n_results; i++) {
        result_rec_t r;
        memcpy(&r, b + 16 + 40 * (uint64_t)i, sizeof r);
        if (r.slot != 0 || r.request_id != 1 || r.generation != 1) continue;
        if (r.first_tensor > h.n_tensors || r.n_tensors > h.n_tensors - r.first_tensor
            || r.msg_offset > h.text_bytes || r.msg_len > h.text_bytes - r.msg_offset)
            die(1, "DONE: a result's spans do not fit the message");
        if (r.status != 0) {
            fprintf(stderr, "shmb_client: request failed, status %u: %.*s\n", r.status, (int)r.msg_len,
                    (const char *)b + text_at + r.msg_offset);
            exit(3);
        }
        for (uint32_t t = 0; t < r.n_tensors; t++) {
            tensor_desc_t o;
            memcpy(&o, b + 16 + 40 * (uint64_t)h.n_results + 88 * (uint64_t)(r.first_tensor + t), sizeof o);
            if (o.index != 0) continue; /* the first output only */
            if (o.dtype != 1 || o.ndim < 1 || o.offset > s->out_cap || o.nbytes > s->out_cap - o.offset)
                die(1, "DONE: output 0 is not float32 or does not fit the output region");
            /* read in place: slot 0's output region, at the descriptor's offset */
            const float *y = (const float *)(s->base + HEADER_BYTES + s->out_offset + o.offset);
            uint64_t per_row = o.dims[0] > 0 ? o.nbytes / 4 / (uint64_t)o.dims[0] : 0;
            for (int64_t row = 0; row < o.dims[0]; row++)
                for (uint64_t j = 0; j < per_row; j++)
                    printf("%.9g%c", y[(uint64_t)row * per_row + j], j + 1 == per_row ? '\n' : ' ');
        }
        return 1;
    }
    return 0;
}

/* Receive one message of any number of frames (at most max) within WAIT_MS; returns the count. */
static int recv_n(void *sock, zmq_msg_t *parts, int max) {
    zmq_pollitem_t item = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, WAIT_MS) <= 0) die(1, "no answer within 30 s (is `shmbroker inline` running?)");
    int n = 0, more = 1;
    while (more) {
        if (n == max) die(1, "too many frames in the answer");
        zmq_msg_init(&parts[n]);
        if (zmq_msg_recv(&parts[n], sock, 0) < 0) die(1, "zmq_msg_recv failed");
        more = zmq_msg_more(&parts[n++]);
    }
    return n;
}

static int kind_of(zmq_msg_t *env) {
    const uint8_t *e = zmq_msg_data(env);
    return zmq_msg_size(env) == 4 && (e[0] | e[1] << 8) == PROTOCOL ? e[2] | e[3] << 8 : -1;
}

/* The image files of a request: their bytes and lengths */
typedef struct { int n; void **data; size_t *len; } images_t;

static images_t read_images(int n, char **paths) {
    images_t im = {n, calloc((size_t)n, sizeof(void *)), calloc((size_t)n, sizeof(size_t))};
    if (!im.data || !im.len) die(1, "out of memory");
    for (int i = 0; i < n; i++) im.data[i] = read_input(paths[i], &im.len[i]);
    return im;
}

static void free_images(images_t *im) {
    for (int i = 0; i < im->n; i++) free(im->data[i]);
    free(im->data);
    free(im->len);
}

/* §10: the same request with the tensor bytes in frames, through `shmbroker inline` (no shared memory); a model
   of images gets one frame per file */
static int inline_main(const char *model, int nfiles, char **files) {
    size_t in_len = 0;
    void *x = NULL;
    images_t im = {0, NULL, NULL};
    char dir[4096], addr[4200], json[1024];
    runtime_dir(dir, sizeof dir);
    snprintf(addr, sizeof addr, "ipc://%s/inline.sock", dir);
    void *ctx = zmq_ctx_new(), *sock = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(sock, addr) != 0) die(1, "cannot connect to inline.sock");
    send2(sock, INLINE_MODELS, "{}", 2); /* the input's name and item shape */
    zmq_msg_t parts[16];
    int n = recv_n(sock, parts, 16);
    if (n != 2 || kind_of(&parts[0]) != INLINE_MODELS_REPLY) die(1, "unexpected answer to INLINE_MODELS");
    js_doc models, reply;
    if (js_parse(&models, zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1])) != 0) die(1, "unparsable JSON body");
    int64_t dims[8] = {0};
    uint8_t ndim = 0;
    const char *in_name;
    int image = 0, len;
    find_model(&models, model, dims, &ndim, &in_name, &image);
    uint8_t env[4] = {PROTOCOL, 0, INLINE_REQUEST, 0};
    if (image) { /* shape [N], then N frames: one image each, its file's bytes as they are */
        im = read_images(nfiles, files);
        len = snprintf(json, sizeof json, "{\"id\":1,\"model\":\"%s\",\"inputs\":[{\"name\":\"%s\",\"dtype\":\"uint8\","
                       "\"shape\":[%d]}]}", model, in_name, nfiles);
        if (zmq_send(sock, env, 4, ZMQ_SNDMORE) != 4 || zmq_send(sock, json, (size_t)len, ZMQ_SNDMORE) != len)
            die(1, "zmq_send failed");
        for (int i = 0; i < nfiles; i++)
            if (zmq_send(sock, im.data[i], im.len[i], i + 1 < nfiles ? ZMQ_SNDMORE : 0) != (int)im.len[i])
                die(1, "zmq_send failed");
    } else {
        if (nfiles != 1) die(1, "a model of tensors takes one input file");
        x = read_input(files[0], &in_len);
        uint64_t item = 4;
        for (int i = 1; i < ndim; i++) item *= (uint64_t)dims[i];
        if (in_len == 0 || in_len % item) die(1, "the input file is not whole rows of the model's input");
        len = snprintf(json, sizeof json, "{\"id\":1,\"model\":\"%s\",\"inputs\":[{\"name\":\"%s\",\"dtype\":\"float32\","
                       "\"shape\":[%" PRIu64, model, in_name, (uint64_t)(in_len / item));
        for (int i = 1; i < ndim; i++) len += snprintf(json + len, sizeof json - (size_t)len, ",%" PRId64, dims[i]);
        len += snprintf(json + len, sizeof json - (size_t)len, "]}]}");
        if (zmq_send(sock, env, 4, ZMQ_SNDMORE) != 4 || zmq_send(sock, json, (size_t)len, ZMQ_SNDMORE) != len
            || zmq_send(sock, x, in_len, 0) != (int)in_len)
            die(1, "zmq_send failed");
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    n = recv_n(sock, parts, 16);
    if (n < 2 || kind_of(&parts[0]) != INLINE_REPLY) die(1, "unexpected answer to INLINE_REQUEST");
    if (js_parse(&reply, zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1])) != 0) die(1, "unparsable JSON body");
    if (strcmp(js_str(&reply, js_get(&reply, 0, "status")), "OK") != 0) {
        fprintf(stderr, "shmb_client: request failed, %s: %s\n", js_str(&reply, js_get(&reply, 0, "status")),
                js_str(&reply, js_get(&reply, 0, "message")));
        exit(3);
    }
    int out0 = js_at(&reply, js_get(&reply, 0, "outputs"), 0), shape = js_get(&reply, out0, "shape");
    int64_t rows = js_int(&reply, js_at(&reply, shape, 0), 0);
    if (n < 3 || rows < 1 || strcmp(js_str(&reply, js_get(&reply, out0, "dtype")), "float32") != 0)
        die(1, "the reply's first output is not float32 rows");
    size_t per_row = zmq_msg_size(&parts[2]) / 4 / (size_t)rows;
    float *y = malloc(zmq_msg_size(&parts[2]) + 4); /* a copy: a small frame's bytes need not be float-aligned */
    if (!y) die(1, "out of memory");
    memcpy(y, zmq_msg_data(&parts[2]), zmq_msg_size(&parts[2]));
    for (int64_t r = 0; r < rows; r++)
        for (size_t j = 0; j < per_row; j++) printf("%.9g%c", y[(size_t)r * per_row + j], j + 1 == per_row ? '\n' : ' ');
    free(y);
    for (int i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    js_free(&models);
    js_free(&reply);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    free(x);
    free_images(&im);
    return 0;
}

/* One session on the broker, linked to the worker of MODEL: HELLO -> SETUP -> the ring -> ATTACHED -> READY ->
   PULL and PUSH linked (§3.1) */
typedef struct {
    void *ctx, *ctl, *push, *pull;
    js_doc setup, ready;
    session_t s;
    uint32_t model_id;
    int64_t dims[8];
    uint8_t ndim;
    const char *in_name;
    int image;
    uint64_t max_items;
} conn_t;

static void open_session(conn_t *c, const char *model, int slots, int max_items) {
    char dir[4096], addr[4200], json[256];
    runtime_dir(dir, sizeof dir);
    snprintf(addr, sizeof addr, "ipc://%s/broker.sock", dir);
    memset(c, 0, sizeof *c);
    c->ctx = zmq_ctx_new();
    c->ctl = zmq_socket(c->ctx, ZMQ_DEALER);
    int linger = 500;
    zmq_setsockopt(c->ctl, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(c->ctl, addr) != 0) die(1, "cannot connect to broker.sock");
    int n = snprintf(json, sizeof json, "{\"protocol\":2,\"pid\":%d,\"slots\":%d,\"max_items\":%d,\"name\":\"c-example\"}",
                     (int)getpid(), slots, max_items);
    send2(c->ctl, HELLO, json, (size_t)n);
    zmq_msg_t body;
    int kind = recv2(c->ctl, &body);
    parse_or_fail(&c->setup, &body, kind, SETUP);
    zmq_msg_close(&body);
    map_segment(&c->s, &c->setup, dir);
    c->model_id = find_model(&c->setup, model, c->dims, &c->ndim, &c->in_name, &c->image);
    c->max_items = (uint64_t)js_int(&c->setup, js_get(&c->setup, 0, "max_items"), 0);
    n = snprintf(json, sizeof json, "{\"session_id\":%u}", c->s.session_id);
    send2(c->ctl, ATTACHED, json, (size_t)n);
    kind = recv2(c->ctl, &body);
    parse_or_fail(&c->ready, &body, kind, READY);
    zmq_msg_close(&body);
    int workers = js_get(&c->ready, 0, "workers"), w = -1;
    for (int k = 0; js_at(&c->ready, workers, k) >= 0 && w < 0; k++) {
        int models = js_get(&c->ready, js_at(&c->ready, workers, k), "models");
        for (int j = 0; js_at(&c->ready, models, j) >= 0; j++)
            if (strcmp(js_str(&c->ready, js_at(&c->ready, models, j)), model) == 0) w = js_at(&c->ready, workers, k);
    }
    if (w < 0) die(1, "no worker in READY serves the model");
    link_worker(c->ctx, js_str(&c->ready, js_get(&c->ready, w, "endpoint")),
                js_str(&c->ready, js_get(&c->ready, w, "reply_endpoint")), &c->push, &c->pull);
}

/* BYE, then the sockets, the mapping and the descriptor (never shm_unlink: the broker does) */
static void close_session(conn_t *c) {
    char json[64];
    int n = snprintf(json, sizeof json, "{\"session_id\":%u}", c->s.session_id);
    send2(c->ctl, BYE, json, (size_t)n);
    zmq_close(c->push);
    zmq_close(c->pull);
    zmq_close(c->ctl); /* linger 500 ms lets BYE out */
    zmq_ctx_term(c->ctx);
    munmap(c->s.base, c->s.bytes);
    close(c->s.fd);
    js_free(&c->setup);
    js_free(&c->ready);
}

/* §4.3: once a slot's inputs are written, its generation, request_id, status, and the state word last (release) */
static void publish(uint8_t *h, uint32_t gen, uint64_t rid) {
    uint32_t zero = 0;
    memcpy(h + 4, &gen, 4);
    memcpy(h + 8, &rid, 8);
    memcpy(h + 16, &zero, 4);
    __atomic_store_n((uint32_t *)h, SUBMITTED, __ATOMIC_RELEASE);
}

/* §4.6: one image as a slot's input (the row table, then its bytes), published; the request's record and
   descriptor for a SUBMIT */
static void publish_image(const conn_t *c, uint32_t slot, uint32_t gen, uint64_t rid, const void *data, size_t len,
                          request_rec_t *rq, tensor_desc_t *td, uint32_t first_tensor) {
    uint8_t *h = c->s.base + HEADER_BYTES + (uint64_t)slot * c->s.stride;
    uint64_t row[2] = {16, len};
    memcpy(h + SLOT_HEADER_BYTES, row, 16);
    memcpy(h + SLOT_HEADER_BYTES + 16, data, len);
    publish(h, gen, rid);
    *rq = (request_rec_t){rid, slot, gen, c->model_id, first_tensor, 1, 0};
    *td = (tensor_desc_t){0, 5, c->ndim, 0, 0, 16 + len, {1}};
}

/* §5.1: n requests, one descriptor each, in one SUBMIT */
static void submit(const conn_t *c, uint8_t *msg, const request_rec_t *rq, const tensor_desc_t *td, uint32_t n) {
    submit_hdr_t sh = {c->s.session_id, n, n, 0, c->s.token};
    memcpy(msg, &sh, 24);
    memcpy(msg + 24, rq, 32 * (size_t)n);
    memcpy(msg + 24 + 32 * (size_t)n, td, 88 * (size_t)n);
    send2(c->push, SUBMIT, msg, 24 + 120 * (size_t)n);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

static int by_value(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* --load: every slot of one session busy with one image a request (the files in turn), each DONE's results
   published again and sent back in one SUBMIT, for a warm-up second, then SECONDS counted; one JSON line */
static int load_main(double seconds, int slots, const char *model, int nfiles, char **files) {
    if (!(seconds > 0) || slots < 1) die(1, "--load takes SECONDS > 0 and SLOTS >= 1");
    images_t im = read_images(nfiles, files);
    conn_t c;
    open_session(&c, model, slots, 1);
    if (!c.image) die(1, "--load sends encoded images: the model's first input is not of kind \"image\"");
    for (int i = 0; i < im.n; i++)
        if (16 + im.len[i] > c.s.in_cap) die(1, "an image does not fit one slot (the model's max_image_bytes)");
    uint32_t n = c.s.n_slots, k = 0, outstanding = 0, *gen = calloc(n, 4), *lat = NULL;
    uint64_t rid = 0, counted = 0, errors = 0, cap = 0, *slot_rid = calloc(n, 8);
    double *sent = calloc(n, sizeof(double));
    request_rec_t *rq = calloc(n, sizeof *rq);
    tensor_desc_t *td = calloc(n, sizeof *td);
    uint8_t *msg = malloc(24 + 120 * (size_t)n);
    if (!gen || !slot_rid || !sent || !rq || !td || !msg) die(1, "out of memory");
    int next = 0;
    for (uint32_t slot = 0; slot < n; slot++, next = (next + 1) % im.n) {
        sent[slot] = now_s();
        slot_rid[slot] = ++rid;
        publish_image(&c, slot, ++gen[slot], rid, im.data[next], im.len[next], &rq[k], &td[k], k);
        k++;
    }
    submit(&c, msg, rq, td, k);
    outstanding = n;
    double begin = now_s() + 1.0, end = begin + seconds, t0 = 0, t1 = 0, cpu0 = 0, cpu1 = 0;
    while (outstanding > 0) {
        zmq_msg_t body;
        int kind = recv2(c.pull, &body);
        const uint8_t *b = zmq_msg_data(&body);
        size_t len = zmq_msg_size(&body);
        done_hdr_t h;
        k = 0;
        if (kind == DONE && len >= sizeof h) {
            memcpy(&h, b, sizeof h);
            uint64_t text_at = 16 + 40 * (uint64_t)h.n_results + 88 * (uint64_t)h.n_tensors;
            if (text_at + h.text_bytes != len) die(1, "DONE: its length disagrees with its header");
            double t = now_s();
            if (t >= begin && t0 == 0) t0 = t, cpu0 = cpu_s();
            if (t >= end && t1 == 0) t1 = t, cpu1 = cpu_s();
            for (uint32_t i = 0; i < h.n_results; i++) {
                result_rec_t r;
                memcpy(&r, b + 16 + 40 * (uint64_t)i, sizeof r);
                if (r.slot >= n || r.request_id != slot_rid[r.slot] || r.generation != gen[r.slot]) continue;
                if (r.msg_offset > h.text_bytes || r.msg_len > h.text_bytes - r.msg_offset)
                    die(1, "DONE: a result's text does not fit the message");
                if (r.status != 0 && errors++ == 0)
                    fprintf(stderr, "shmb_client: a request failed, status %u: %.*s\n", r.status, (int)r.msg_len,
                            (const char *)b + text_at + r.msg_offset);
                if (t0 != 0 && t1 == 0) {
                    if (counted == cap) {
                        cap = cap ? 2 * cap : 65536;
                        lat = realloc(lat, cap * 4);
                        if (!lat) die(1, "out of memory");
                    }
                    lat[counted++] = (uint32_t)((t - sent[r.slot]) * 1e6);
                }
                if (t1 != 0) {
                    outstanding--;
                    continue;
                }
                sent[r.slot] = t;
                slot_rid[r.slot] = ++rid;
                publish_image(&c, r.slot, ++gen[r.slot], rid, im.data[next], im.len[next], &rq[k], &td[k], k);
                next = (next + 1) % im.n;
                k++;
            }
        }
        zmq_msg_close(&body);
        if (k > 0) submit(&c, msg, rq, td, k);
    }
    qsort(lat, counted, 4, by_value);
    double window = t1 - t0, per_s = window > 0 ? (double)counted / window : 0.0;
    printf("{\"model\":\"%s\",\"slots\":%u,\"images\":%d,\"requests\":%" PRIu64 ",\"errors\":%" PRIu64
           ",\"seconds\":%.3f,\"per_s\":%.1f,\"cpu_us_per_request\":%.2f,\"p50_us\":%u,\"p99_us\":%u}\n",
           model, n, im.n, counted, errors, window, per_s, counted ? (cpu1 - cpu0) * 1e6 / (double)counted : 0.0,
           counted ? lat[counted / 2] : 0, counted ? lat[counted * 99 / 100] : 0);
    close_session(&c);
    free(gen);
    free(slot_rid);
    free(sent);
    free(rq);
    free(td);
    free(msg);
    free(lat);
    free_images(&im);
    return errors ? 3 : 0;
}

int main(int argc, char **argv) {
    const char *usage = "usage: shmb_client [--inline] MODEL INPUT.f32 | shmb_client [--inline] MODEL IMAGE... | "
                        "shmb_client --load SECONDS SLOTS MODEL IMAGE...";
    if (argc > 1 && strcmp(argv[1], "--load") == 0) {
        if (argc < 6) die(1, usage);
        return load_main(atof(argv[2]), atoi(argv[3]), argv[4], argc - 5, argv + 5);
    }
    int inline_mode = argc > 1 && strcmp(argv[1], "--inline") == 0;
    if (argc < 3 + inline_mode) die(1, usage);
    if (inline_mode) return inline_main(argv[2], argc - 3, argv + 3);
    size_t in_len = 0;
    void *x = NULL;
    images_t im = {0, NULL, NULL};

    /* HELLO: the item size is not known before SETUP, so ask for a generous max_items (the broker clamps it
     * to the largest max_batch) and check the rows against the grant below */
    conn_t c;
    open_session(&c, argv[1], 1, 1024);
    session_t s = c.s;
    uint8_t dtype = 1; /* float32; an input of images is uint8 (§4.6) */
    int64_t *dims = c.dims;
    if (c.image) {
        /* §4.6: the row table (offset, length: u64 each, from the input's start), then the images in order.
           Their lengths are the worker's to check against max_bytes; the slot must only hold them. */
        im = read_images(argc - 2, argv + 2);
        in_len = 16 * (uint64_t)im.n;
        for (int i = 0; i < im.n; i++) in_len += im.len[i];
        if ((uint64_t)im.n > c.max_items || in_len > s.in_cap)
            die(1, "the images do not fit one slot: more rows than this session's max_items, or past in_capacity");
        x = malloc(in_len);
        if (!x) die(1, "out of memory");
        uint64_t at = 16 * (uint64_t)im.n;
        for (int i = 0; i < im.n; i++) {
            uint64_t row[2] = {at, im.len[i]};
            memcpy((uint8_t *)x + 16 * (uint64_t)i, row, 16);
            memcpy((uint8_t *)x + at, im.data[i], im.len[i]);
            at += im.len[i];
        }
        dims[0] = im.n;
        dtype = 5;
    } else {
        if (argc != 3) die(1, usage);
        x = read_input(argv[2], &in_len);
        uint64_t item = 4;
        for (int i = 1; i < c.ndim; i++) item *= (uint64_t)dims[i];
        if (in_len == 0 || in_len % item) die(1, "the input file is not whole rows of the model's input");
        dims[0] = (int64_t)(in_len / item);
        if ((uint64_t)dims[0] > c.max_items || in_len > s.in_cap) die(1, "more rows than this session's max_items");
    }

    /* the inputs into slot 0, published; one request, one tensor */
    uint8_t *slot = s.base + HEADER_BYTES, msg[24 + 32 + 88];
    memcpy(slot + SLOT_HEADER_BYTES, x, in_len);
    publish(slot, 1, 1);
    request_rec_t rq = {1, 0, 1, c.model_id, 0, 1, 0};
    tensor_desc_t td = {0, dtype, c.ndim, 0, 0, in_len, {0}};
    memcpy(td.dims, dims, sizeof td.dims);
    submit(&c, msg, &rq, &td, 1);

    for (;;) {
        zmq_msg_t body;
        int kind = recv2(c.pull, &body);
        int ours = kind == DONE && handle_done(&s, &body);
        zmq_msg_close(&body);
        if (ours) break;
    }
    close_session(&c);
    free(x);
    free_images(&im);
    return 0;
}
