/* minijson.h: just enough JSON to read shmbroker's SETUP and READY bodies (docs/PROTOCOL.md §2.2).
 *
 * The broker's bodies are compact msgspec output: objects, arrays, strings, integers (up to 2^63, so they are
 * kept as text and converted with strtoll/strtoull, never through double), true/false/null. This parser
 * builds a flat array of nodes from one body; a node's children follow it in the array. Escapes in strings
 * are decoded only for \" \\ \/ and the single-byte \u00XX range the broker emits for control characters;
 * anything else is refused. Header-only; for one program, not a general library.
 */
#ifndef MINIJSON_H
#define MINIJSON_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { JS_OBJ, JS_ARR, JS_STR, JS_NUM, JS_TRUE, JS_FALSE, JS_NULL };

typedef struct {
    int type;
    int size;     /* objects: keys; arrays: items */
    int end;      /* index of the first node after this one's subtree */
    char *text;   /* strings (decoded, NUL-terminated) and numbers (as written, NUL-terminated) */
} js_node;

typedef struct {
    js_node *nodes;
    int n, cap;
    char *buf;   /* a private copy of the body; strings are decoded in place */
    char *p;
    char *end;
} js_doc;

static int js_value(js_doc *d);

static void js_ws(js_doc *d) {
    while (d->p < d->end && (*d->p == ' ' || *d->p == '\n' || *d->p == '\r' || *d->p == '\t')) d->p++;
}

static int js_new(js_doc *d, int type) {
    if (d->n == d->cap) {
        int cap = d->cap ? d->cap * 2 : 64;
        js_node *nn = realloc(d->nodes, (size_t)cap * sizeof *nn);
        if (!nn) return -1;
        d->nodes = nn;
        d->cap = cap;
    }
    d->nodes[d->n] = (js_node){type, 0, 0, NULL};
    return d->n++;
}

static int js_string(js_doc *d) {
    int i = js_new(d, JS_STR);
    if (i < 0) return -1;
    char *out = ++d->p, *start = out; /* decode in place: the output never outruns the input */
    while (d->p < d->end && *d->p != '"') {
        char c = *d->p++;
        if (c == '\\') {
            if (d->p >= d->end) return -1;
            char e = *d->p++;
            if (e == '"' || e == '\\' || e == '/') c = e;
            else if (e == 'n') c = '\n';
            else if (e == 't') c = '\t';
            else if (e == 'u' && d->end - d->p >= 4 && d->p[0] == '0' && d->p[1] == '0') {
                char hex[3] = {d->p[2], d->p[3], 0};
                c = (char)strtol(hex, NULL, 16);
                d->p += 4;
            } else return -1;
        }
        *out++ = c;
    }
    if (d->p >= d->end) return -1;
    d->p++;   /* the closing quote */
    *out = 0; /* safe: out < p */
    d->nodes[i].text = start;
    d->nodes[i].end = d->n;
    return i;
}

static int js_container(js_doc *d, int type, char close) {
    int i = js_new(d, type);
    if (i < 0) return -1;
    d->p++;
    js_ws(d);
    if (d->p < d->end && *d->p == close) {
        d->p++;
        d->nodes[i].end = d->n;
        return i;
    }
    for (;;) {
        js_ws(d);
        if (type == JS_OBJ) {
            if (d->p >= d->end || *d->p != '"' || js_string(d) < 0) return -1;
            js_ws(d);
            if (d->p >= d->end || *d->p++ != ':') return -1;
        }
        if (js_value(d) < 0) return -1;
        d->nodes[i].size++;
        js_ws(d);
        if (d->p >= d->end) return -1;
        if (*d->p == ',') { d->p++; continue; }
        if (*d->p++ != close) return -1;
        d->nodes[i].end = d->n;
        return i;
    }
}

static int js_scalar(js_doc *d) {
    static const struct { const char *w; int t; } words[] = {{"true", JS_TRUE}, {"false", JS_FALSE}, {"null", JS_NULL}};
    for (size_t k = 0; k < 3; k++) {
        size_t n = strlen(words[k].w);
        if ((size_t)(d->end - d->p) >= n && memcmp(d->p, words[k].w, n) == 0) {
            d->p += n;
            int i = js_new(d, words[k].t);
            if (i >= 0) d->nodes[i].end = d->n;
            return i;
        }
    }
    char *start = d->p;
    while (d->p < d->end && strchr("-+0123456789.eE", *d->p)) d->p++;
    if (d->p == start) return -1;
    int i = js_new(d, JS_NUM);
    if (i < 0) return -1;
    /* the number's text is terminated by copying it: the next byte is still needed by the parser */
    size_t n = (size_t)(d->p - start);
    char *t = malloc(n + 1);
    if (!t) return -1;
    memcpy(t, start, n);
    t[n] = 0;
    d->nodes[i].text = t;
    d->nodes[i].end = d->n;
    return i;
}

static int js_value(js_doc *d) {
    js_ws(d);
    if (d->p >= d->end) return -1;
    if (*d->p == '{') return js_container(d, JS_OBJ, '}');
    if (*d->p == '[') return js_container(d, JS_ARR, ']');
    if (*d->p == '"') return js_string(d);
    return js_scalar(d);
}

/* Parse len bytes; 0 on success. Node 0 is the root. */
static int js_parse(js_doc *d, const void *body, size_t len) {
    memset(d, 0, sizeof *d);
    d->buf = malloc(len + 1);
    if (!d->buf) return -1;
    memcpy(d->buf, body, len);
    d->buf[len] = 0;
    d->p = d->buf;
    d->end = d->buf + len;
    return js_value(d) == 0 ? 0 : -1;
}

static void js_free(js_doc *d) {
    for (int i = 0; i < d->n; i++)
        if (d->nodes[i].type == JS_NUM) free(d->nodes[i].text);
    free(d->nodes);
    free(d->buf);
    memset(d, 0, sizeof *d);
}

/* The value of key in object node obj, or -1. */
static int js_get(const js_doc *d, int obj, const char *key) {
    if (obj < 0 || d->nodes[obj].type != JS_OBJ) return -1;
    int i = obj + 1;
    for (int k = 0; k < d->nodes[obj].size; k++) {
        int v = i + 1;
        if (strcmp(d->nodes[i].text, key) == 0) return v;
        i = d->nodes[v].end;
    }
    return -1;
}

/* Item idx of array node arr, or -1. */
static int js_at(const js_doc *d, int arr, int idx) {
    if (arr < 0 || d->nodes[arr].type != JS_ARR || idx < 0 || idx >= d->nodes[arr].size) return -1;
    int i = arr + 1;
    while (idx--) i = d->nodes[i].end;
    return i;
}

static int64_t js_int(const js_doc *d, int i, int64_t fallback) {
    return (i >= 0 && d->nodes[i].type == JS_NUM) ? strtoll(d->nodes[i].text, NULL, 10) : fallback;
}

static uint64_t js_uint(const js_doc *d, int i) {
    return (i >= 0 && d->nodes[i].type == JS_NUM) ? strtoull(d->nodes[i].text, NULL, 10) : 0;
}

static const char *js_str(const js_doc *d, int i) {
    return (i >= 0 && d->nodes[i].type == JS_STR) ? d->nodes[i].text : "";
}

#endif
