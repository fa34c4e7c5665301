// `relay serve` on a temporary SQLite file, and the operator CLI on the same file: the fixture the
// SDK tests share. The bearer token stays in memory; it is never printed.
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, openSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';

const START_BOUND_MS = 30_000; // only a broken server reaches it

export class Relay {
  constructor() {
    this.bin = process.env.RELAY_BIN;
    if (!this.bin) throw new Error('set RELAY_BIN to the relay binary');
    this.dir = mkdtempSync(join(tmpdir(), 'relay-ts-'));
    this.env = { ...process.env, RELAY_DB: `sqlite:${this.dir}/relay.db` };
  }

  cli(...args) {
    return execFileSync(this.bin, args, { env: this.env, encoding: 'utf8', timeout: 60_000 }).trim();
  }

  // Starts `relay serve`; serveArgs are further flags (e.g. '--task-poll-interval', '100ms').
  async start(...serveArgs) {
    const log = openSync(join(this.dir, 'serve.log'), 'w');
    this.proc = spawn(this.bin, ['serve', '--listen', '127.0.0.1:0', ...serveArgs], {
      env: this.env,
      stdio: ['ignore', 'pipe', log],
    });
    const lines = createInterface({ input: this.proc.stdout });
    const first = await new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`relay serve printed nothing; log: ${this.log()}`)), START_BOUND_MS);
      lines.once('line', (line) => { clearTimeout(timer); resolve(line); });
      this.proc.once('exit', (code) => { clearTimeout(timer); reject(new Error(`relay serve exited ${code}; log: ${this.log()}`)); });
    });
    const prefix = 'listening on ';
    if (!first.startsWith(prefix)) throw new Error(`unexpected first line ${first}`);
    this.base = first.slice(prefix.length).trim();
    lines.on('line', () => {}); // keep draining stdout
  }

  log() {
    try { return readFileSync(join(this.dir, 'serve.log'), 'utf8').slice(-2000); } catch { return ''; }
  }

  url(endpoint) {
    return new URL(`${this.base}/mcp/${endpoint}`);
  }

  async stop() {
    if (this.proc && this.proc.exitCode === null) {
      const exited = new Promise((resolve) => this.proc.once('exit', resolve));
      this.proc.kill('SIGTERM'); // the graceful stop
      await exited;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

// The structured answer of a successful tool call; the text content repeats it.
export function answer(result) {
  if (result.isError) throw new Error(`unexpected tool error: ${JSON.stringify(result.structuredContent)}`);
  const out = result.structuredContent;
  const text = result.content.find((c) => c.type === 'text');
  if (!text || JSON.stringify(JSON.parse(text.text)) !== JSON.stringify(out)) {
    throw new Error('the text content does not repeat structuredContent');
  }
  return out;
}

// Resolves with the promise, or rejects after ms: a bound on waiting for an event.
export function within(ms, promise, what) {
  let timer;
  const bound = new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(`${what}: nothing within ${ms} ms`)), ms); });
  return Promise.race([promise, bound]).finally(() => clearTimeout(timer));
}

// Drains a queue through an SDK client: fenced claim_next, a heartbeat with the lease token, and
// complete, until claim_next answers empty. Bounded by the number of todos expected (+1).
export async function drain(client, queue, expected) {
  const done = [];
  for (let i = 0; i <= expected.length; i++) {
    const got = answer(await client.callTool({ name: 'claim_next', arguments: { queue, require_fence: true } }));
    if (got.empty) break;
    const id = got.todo.id;
    const token = got.lease_token;
    if (typeof token !== 'string' || token.length < 22) throw new Error('a fenced claim has a lease token');
    const hb = answer(await client.callTool({ name: 'heartbeat', arguments: { id, lease_token: token } }));
    if (hb.state !== 'claimed') throw new Error(`heartbeat answered ${hb.state}`);
    // A stale token is fenced off.
    const stale = await client.callTool({ name: 'heartbeat', arguments: { id, lease_token: 'A'.repeat(22) } });
    if (!stale.isError || stale.structuredContent.error.code !== 'conflict') throw new Error('a wrong lease token was not refused');
    const fin = answer(await client.callTool({ name: 'complete', arguments: { id, lease_token: token, summary: 'drained' } }));
    if (fin.state !== 'done') throw new Error(`complete answered ${fin.state}`);
    done.push(id);
  }
  return done;
}
