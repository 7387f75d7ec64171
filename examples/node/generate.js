#!/usr/bin/env node
// Streams pagedserve.v1.TextGenerationService/Generate for a prompt and prints the text as it arrives,
// then the finish reason. The contracts are loaded at run time from the repository's proto/ folder, the
// include root every .proto file's imports are relative to.
//
//   node generate.js [--address HOST:PORT] [--api-key KEY] [--max-tokens N] [--temperature T] [--chat] PROMPT
"use strict";

const path = require("node:path");
const { parseArgs } = require("node:util");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const USAGE = `usage: node generate.js [options] PROMPT

  --address HOST:PORT  the gateway's gRPC port (default 127.0.0.1:50051)
  --api-key KEY        sent as "authorization: Bearer KEY" (default $PAGEDSERVE_API_KEY)
  --max-tokens N       most tokens to generate (default 64)
  --temperature T      0 is greedy (default: the server's, 1.0)
  --chat               send the prompt as a user message, rendered with the model's chat template`;

function parse(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      address: { type: "string", default: "127.0.0.1:50051" },
      "api-key": { type: "string", default: process.env.PAGEDSERVE_API_KEY || "" },
      "max-tokens": { type: "string", default: "64" },
      temperature: { type: "string" },
      chat: { type: "boolean", default: false },
      help: { type: "boolean", short: "h", default: false },
    },
  });
  if (values.help) {
    console.log(USAGE);
    process.exit(0);
  }
  if (positionals.length !== 1) {
    throw new Error("give exactly one PROMPT (quote it)");
  }
  const maxTokens = Number(values["max-tokens"]);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) {
    throw new Error(`--max-tokens must be a positive integer, not ${values["max-tokens"]}`);
  }
  const sampling = { max_tokens: maxTokens };
  if (values.temperature !== undefined) {
    sampling.temperature = Number(values.temperature);
    if (Number.isNaN(sampling.temperature)) {
      throw new Error(`--temperature must be a number, not ${values.temperature}`);
    }
  }
  const prompt = positionals[0];
  const request = values.chat
    ? { messages: [{ role: "user", content: prompt }], sampling }
    : { prompt, sampling };
  return { address: values.address, apiKey: values["api-key"], request };
}

function loadService() {
  const definition = protoLoader.loadSync("pagedserve/v1/text_generation.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto files: max_tokens, finish_reason
    enums: String,
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).pagedserve.v1.TextGenerationService;
}

function main() {
  let options;
  try {
    options = parse(process.argv.slice(2));
  } catch (error) {
    console.error(`${error.message}\n\n${USAGE}`);
    process.exit(2);
  }
  const TextGenerationService = loadService();
  const client = new TextGenerationService(options.address, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  if (options.apiKey) {
    // The gateway takes the key the way the HTTP API does (gateway/grpc_api.py).
    metadata.set("authorization", `Bearer ${options.apiKey}`);
  }

  let finishReason = "";
  const call = client.Generate(options.request, metadata);
  // Ctrl-C closes the stream, which aborts the request on the server.
  process.once("SIGINT", () => call.cancel());
  call.on("data", (response) => {
    process.stdout.write(response.text);
    if (response.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      finishReason = response.finish_reason.replace("FINISH_REASON_", "").toLowerCase();
    }
  });
  // NOTE: the stream ends ("end") whether the call succeeded or not; the status, which comes last, tells.
  call.on("error", () => {});
  call.on("status", (status) => {
    client.close();
    if (status.code === grpc.status.OK) {
      process.stdout.write(`\nfinish_reason: ${finishReason}\n`);
      return;
    }
    console.error(`\nerror: ${grpc.status[status.code]}: ${status.details}`);
    process.exitCode = status.code === grpc.status.CANCELLED ? 130 : 1;
  });
}

main();
