// One inference through shmbroker's HTTP front-end on its Unix socket (`shmbroker http --unix PATH`), from
// Node with nothing but its standard library. The input goes as raw bytes (the KServe binary tensor
// extension), the outputs come back as JSON.
//
//   node examples/node/infer.mjs /run/shmbroker-http/http.sock tiny 0.5
//
// Fills the model's first input (one row, its dtype FP32) with VALUE (default 1) and prints
// {"model_name": ..., "outputs": [{"name", "datatype", "shape", "data"}]} on stdout. Exit 1 with the
// front-end's error on stderr when it refuses the request (its text names the field), 2 on bad arguments.
import http from "node:http";

function call(socketPath, method, path, body, headers = {}) {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath, method, path, headers }, (res) => {
      const chunks = [];
      res.on("data", (c) => chunks.push(c));
      res.on("end", () => resolve({ status: res.statusCode, body: Buffer.concat(chunks) }));
    });
    req.on("error", reject);
    req.end(body);
  });
}

function fail(code, message) {
  process.stderr.write(`infer.mjs: ${message}\n`);
  process.exit(code);
}

const [socketPath, model, valueArg = "1"] = process.argv.slice(2);
const value = Number(valueArg);
if (!socketPath || !model || !Number.isFinite(value)) {
  fail(2, "usage: node infer.mjs SOCKET MODEL [VALUE]");
}

const meta = await call(socketPath, "GET", `/v2/models/${encodeURIComponent(model)}`);
if (meta.status !== 200) fail(1, `model ${model}: ${meta.status} ${meta.body}`);
const input = JSON.parse(meta.body).inputs[0];
if (input.datatype !== "FP32") fail(2, `input ${input.name} is ${input.datatype}; this example sends FP32 only`);
const shape = input.shape.map((d, i) => (i === 0 || d < 0 ? 1 : d)); // one row
const x = new Float32Array(shape.reduce((a, b) => a * b, 1)).fill(value);

const header = Buffer.from(JSON.stringify({
  inputs: [{ name: input.name, datatype: "FP32", shape, parameters: { binary_data_size: x.byteLength } }],
}));
const res = await call(socketPath, "POST", `/v2/models/${encodeURIComponent(model)}/infer`,
  Buffer.concat([header, Buffer.from(x.buffer)]),
  { "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": String(header.length) });
if (res.status !== 200) fail(1, `infer: ${res.status} ${res.body}`);
process.stdout.write(res.body.toString() + "\n");
