// Greedy generation over an `ortpa convert --portable` file in Node.js with onnxruntime-node (no ortpa):
//
//   npm install --ignore-scripts      # the CPU binaries are in the package; its install script fetches GPU ones
//   node greedy.js model.onnx 1,2,3 7,8 --max-new-tokens 16
//
// prints {"outputs": [[ids...], ...]} in prompt order, as `ortpa generate --json` and examples/portable_greedy.py
// (the same loop in Python, docs/converted_model.md) do for the same prompts.
"use strict";
const ort = require("onnxruntime-node");

const ELEMENTS = { float16: Uint16Array, float32: Float32Array, int8: Int8Array };

async function greedy(session, prompts, maxNewTokens, blockSize = 16) {
  const caches = session.inputMetadata.filter((m) => m.name.startsWith("past_key_values."));
  const inputs = new Set(session.inputNames);
  // each sequence owns the blocks of its whole generation, in a row of the block table (-1 = unmapped)
  const perSeq = Math.ceil(Math.max(...prompts.map((p) => p.length + maxNewTokens)) / blockSize);
  const numBlocks = prompts.length * perSeq;
  const ids = Int32Array.from({ length: numBlocks }, (_, i) => i);
  const blockTable = new ort.Tensor("int32", ids, [prompts.length, perSeq]);
  let kv = {};
  for (const c of caches) {
    const shape = [numBlocks, blockSize, ...c.shape.slice(2)];
    kv[c.name] = new ort.Tensor(c.type, new ELEMENTS[c.type](shape.reduce((a, b) => a * b, 1)), shape);
  }
  const past = new Int32Array(prompts.length); // tokens already in the cache, per sequence
  let fresh = prompts.map((p) => p.slice()); // each sequence's tokens to feed this step
  const out = prompts.map(() => []);
  for (let step = 0; step < maxNewTokens; step++) {
    const lengths = fresh.map((t) => t.length);
    const cu = new Int32Array(lengths.length + 1); // 0, n0, n0+n1, ...
    lengths.forEach((n, s) => (cu[s + 1] = cu[s] + n));
    const kvLen = Math.max(...lengths.map((n, s) => past[s] + n));
    const feeds = {
      input_ids: new ort.Tensor("int64", BigInt64Array.from(fresh.flat(), BigInt), [cu[cu.length - 1]]),
      cumulative_sequence_lengths: new ort.Tensor("int32", cu, [cu.length]),
      past_sequence_lengths: new ort.Tensor("int32", Int32Array.from(past), [past.length]),
      block_table: blockTable,
      // max query length, max KV length (past + new), and a lower bound on the longest KV length
      attention_metadata: new ort.Tensor("int32", Int32Array.from([Math.max(...lengths), kvLen, kvLen]), [3]),
      ...kv,
    };
    for (const name of Object.keys(feeds)) if (!inputs.has(name)) delete feeds[name];
    const results = await session.run(feeds);
    const next = {}; // the written caches are the next step's input
    for (const c of caches) next[c.name] = results[c.name.replace("past_key_values.", "present.")];
    kv = next;
    const logits = results.logits; // [batch, vocab]: one row per sequence's last token
    const vocab = logits.dims[1];
    for (let s = 0; s < prompts.length; s++) {
      const row = logits.data.subarray(s * vocab, (s + 1) * vocab);
      let best = 0;
      for (let v = 1; v < vocab; v++) if (row[v] > row[best]) best = v;
      out[s].push(best);
      past[s] += lengths[s];
      fresh[s] = [best];
    }
  }
  return out;
}

async function main() {
  const args = process.argv.slice(2);
  let maxNew = 16;
  const at = args.indexOf("--max-new-tokens");
  if (at >= 0) maxNew = Number(args.splice(at, 2)[1]);
  const [model, ...prompts] = args;
  const session = await ort.InferenceSession.create(model, { executionProviders: ["cpu"] });
  const outputs = await greedy(session, prompts.map((p) => p.split(",").map(Number)), maxNew);
  console.log(JSON.stringify({ outputs }));
}

module.exports = { greedy };
if (require.main === module) {
  main().catch((e) => {
    console.error(e.message || e);
    process.exit(1);
  });
}
