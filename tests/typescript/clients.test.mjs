// The official MCP TypeScript SDKs against `relay serve` (the real binary, RELAY_BIN):
// - v2 (@modelcontextprotocol/client) negotiating the 2026-07-28 era (`versionNegotiation`
//   'auto', which must settle on it): drains a queue with fenced claims, heartbeats and reports,
//   and hears the doorbell on `client.listen({resourceSubscriptions})` when a todo is added;
// - v1 (@modelcontextprotocol/sdk) in the legacy initialize/session era: drains a queue; and 70
//   v1 clients whose ordinary connect/close() never sends DELETE do not lock the 71st out.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';

import { Client as ClientV2, StreamableHTTPClientTransport as TransportV2 } from '@modelcontextprotocol/client';
import { Client as ClientV1 } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport as TransportV1 } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

import { Relay, answer, drain, within } from './relay.mjs';

const ENDPOINT = 'worker';
const MODERN = '2026-07-28';
const CROWD = 'crowd'; // the lock-out test's own endpoint, so that no other session counts
const CROWD_CLIENTS = 70; // above the server's default per-endpoint session cap (64)
const DOORBELL_BOUND_MS = 30_000; // the server's doorbell scan finds a CLI add within 5 s
const relay = new Relay();
let token;
let crowdToken;

function add(queue, title) {
  return relay.cli('todo', 'add', '--endpoint', ENDPOINT, '--queue', queue, '--title', title);
}

function todoState(id) {
  return JSON.parse(relay.cli('todo', 'show', id, '--json')).todo.state;
}

before(async () => {
  token = relay.cli('endpoint', 'create', ENDPOINT, '--verbs', 'claim_next,heartbeat,complete,list_todos',
    '--queues', 'v2,v2-bell,v1');
  crowdToken = relay.cli('endpoint', 'create', CROWD, '--verbs', 'claim_next', '--queues', 'crowd');
  await relay.start();
});

after(async () => {
  await relay.stop();
});

const auth = () => ({ requestInit: { headers: { Authorization: `Bearer ${token}` } } });

test('v2 client in the 2026-07-28 era drains a queue and hears the doorbell', async () => {
  const todos = [add('v2', 'one'), add('v2', 'two')];
  const client = new ClientV2({ name: 'relay-ts-v2', version: '0' }, { versionNegotiation: { mode: 'auto' } });
  await client.connect(new TransportV2(relay.url(ENDPOINT), auth()));
  try {
    assert.equal(client.getNegotiatedProtocolVersion(), MODERN, 'auto settled on the modern era');
    const tools = (await client.listTools()).tools.map((t) => t.name).sort();
    assert.deepEqual(tools, ['claim_next', 'complete', 'get_todo', 'heartbeat', 'list_todos']);
    assert.deepEqual((await drain(client, 'v2', todos)).sort(), [...todos].sort());
    for (const id of todos) assert.equal(todoState(id), 'done');

    // The doorbell: listen on the empty queue's resource, add a todo from the CLI.
    const uri = 'relay://queues/v2-bell';
    let heard;
    const rung = new Promise((resolve) => { heard = resolve; });
    client.setNotificationHandler('notifications/resources/updated', (n) => heard(n.params.uri));
    const sub = await client.listen({ resourceSubscriptions: [uri] });
    try {
      assert.deepEqual(sub.honoredFilter.resourceSubscriptions, [uri]);
      const bell = add('v2-bell', 'rung');
      assert.equal(await within(DOORBELL_BOUND_MS, rung, 'the doorbell'), uri);
      assert.deepEqual(await drain(client, 'v2-bell', [bell]), [bell]);
    } finally {
      await sub.close();
    }
  } finally {
    await client.close();
  }
});

test('v1 client in the legacy era drains a queue', async () => {
  const todos = [add('v1', 'one'), add('v1', 'two')];
  const client = new ClientV1({ name: 'relay-ts-v1', version: '0' });
  await client.connect(new TransportV1(relay.url(ENDPOINT), auth()));
  try {
    assert.notEqual(client.getServerVersion(), undefined);
    assert.equal(client.getServerVersion().name, 'relay');
    assert.deepEqual((await drain(client, 'v1', todos)).sort(), [...todos].sort());
    for (const id of todos) assert.equal(todoState(id), 'done');
  } finally {
    await client.close();
  }
});

// The server ends the least recently used session without an open stream at the per-endpoint cap
// (64), and forgets a stream's note in the store as soon as its connection closes.
test('70 v1 clients that never send DELETE do not lock the 71st out', async () => {
  for (let i = 0; i <= CROWD_CLIENTS; i++) {
    const client = new ClientV1({ name: `relay-ts-crowd-${i}`, version: '0' });
    // The v1 SDK's connect opens the GET stream; its close() aborts it and sends no DELETE.
    await client.connect(new TransportV1(relay.url(CROWD), {
      requestInit: { headers: { Authorization: `Bearer ${crowdToken}` } },
    }));
    try {
      assert.equal(answer(await client.callTool({ name: 'claim_next', arguments: { queue: 'crowd' } })).empty, true);
    } finally {
      await client.close();
    }
  }
});
