// The official MCP Tasks extension client (@modelcontextprotocol/ext-tasks, on the v2 SDK
// @modelcontextprotocol/client, 2026-07-28 era) against `relay serve` (the real binary,
// RELAY_BIN): add_todo called through the library's task session becomes a task; a worker (a
// second plain client of the same endpoint: todos belong to the endpoint that added them) claims
// and finishes the todo, and the library drives the task to its outcome:
// - a completed todo's result arrives as the task's CallToolResult;
// - a worker's question (request_input) surfaces as an elicitation/create input request and is
//   answered through the session's onInputRequest; the next claim reads the answer;
// - cancelling through the library cancels the todo;
// - notifications/tasks on a subscriptions/listen stream (taskIds) settle a task that polling
//   would not reach for a minute.
//
// For a 2026-07-28 Tasks server the library needs the host's own request path (`rawDispatch`: the
// SDK Client's result decoding rejects `resultType: "task"`) and the request framing the SDK
// keeps private (`v2RequestFraming`); `connect` below supplies both over the SDK's own transport.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';
import {
  createApplicationInputHandler,
  createTaskSessionFromClient,
  resultFromTaskOutcome,
} from '@modelcontextprotocol/ext-tasks/client';
import { contributeTaskFilterV2 } from '@modelcontextprotocol/ext-tasks/core/v2';

import { Relay, answer, within } from './relay.mjs';

const EXTENSION = 'io.modelcontextprotocol/tasks';
const MODERN = '2026-07-28';
const ENDPOINT = 'tasks';
const VERBS = 'add_todo,claim_next,heartbeat,complete,request_input,get_todo,list_todos';
const QUEUES = 'done,asked,cancel,heard';
const QUESTION = 'Which region?';
const ANSWER = 'eu-west';
const POLL = '100ms'; // the server's pollIntervalMs: the library polls this often
const SLOW_POLL = '60s'; // the listen test's server: the next poll, and the watcher's next look
const BOUND_MS = 30_000; // only a broken server or library reaches it

const relay = new Relay();
const slow = new Relay();
let token;
let slowToken;

before(async () => {
  token = relay.cli('endpoint', 'create', ENDPOINT, '--verbs', VERBS, '--queues', QUEUES);
  slowToken = slow.cli('endpoint', 'create', ENDPOINT, '--verbs', VERBS, '--queues', QUEUES);
  await relay.start('--task-poll-interval', POLL);
  await slow.start('--task-poll-interval', SLOW_POLL);
});

after(async () => {
  await relay.stop();
  await slow.stop();
});

// The host's request coordinator for the library's V2 traffic (tools/call and tasks/*): it owns
// its request ids, sends over the connected SDK transport (which sets the Mcp-Method and Mcp-Name
// headers from the body) and takes the matching responses before the SDK's own dispatch sees them.
// `sent` records each request's method.
function hostCoordinator(transport, sent) {
  const pending = new Map();
  let next = 0;
  const sdk = transport.onmessage;
  transport.onmessage = (message, extra) => {
    const waiter = message && !('method' in message) ? pending.get(message.id) : undefined;
    if (waiter === undefined) return sdk?.(message, extra);
    pending.delete(message.id);
    waiter.resolve(message);
  };
  return async (request, options = {}) => {
    const id = `ext-tasks-${++next}`;
    sent.push(request.method);
    const response = new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
    const abort = () => {
      pending.get(id)?.reject(options.signal.reason ?? new Error('aborted'));
      pending.delete(id);
    };
    options.signal?.addEventListener('abort', abort, { once: true });
    try {
      await transport.send({ jsonrpc: '2.0', id, ...request }, {
        requestSignal: options.signal,
        ...(options.context?.headers ? { headers: options.context.headers } : {}),
      });
      const message = await response;
      return 'error' in message
        ? { kind: 'error', error: message.error }
        : { kind: 'result', result: message.result };
    } finally {
      pending.delete(id);
      options.signal?.removeEventListener('abort', abort);
    }
  };
}

// An SDK client of `server`'s endpoint that declares the Tasks extension, connected, with the
// ext-tasks session over it (options: the session's, e.g. onInputRequest).
async function connect(server, bearer, name, options = {}) {
  const info = { name, version: '0' };
  const capabilities = { extensions: { [EXTENSION]: {} } };
  const client = new Client(info, { capabilities, versionNegotiation: { mode: 'auto' } });
  const transport = new StreamableHTTPClientTransport(server.url(ENDPOINT), {
    requestInit: { headers: { Authorization: `Bearer ${bearer}` } },
  });
  await client.connect(transport);
  assert.equal(client.getNegotiatedProtocolVersion(), MODERN);
  const errors = [];
  const sent = [];
  const session = createTaskSessionFromClient(client, {
    endpointId: `relay-${name}`,
    rawDispatch: hostCoordinator(transport, sent),
    v2RequestFraming: { protocolVersion: MODERN, clientInfo: info, clientCapabilities: capabilities },
    onError: (e) => errors.push(e),
    ...options,
  });
  const close = async () => {
    await session.close();
    await client.close();
  };
  return { client, session, errors, sent, close };
}

// A plain SDK client of the same endpoint: the worker.
async function worker(server, bearer) {
  const client = new Client({ name: 'relay-ts-worker', version: '0' }, { versionNegotiation: { mode: 'auto' } });
  await client.connect(new StreamableHTTPClientTransport(server.url(ENDPOINT), {
    requestInit: { headers: { Authorization: `Bearer ${bearer}` } },
  }));
  const call = async (name, args) => answer(await client.callTool({ name, arguments: args }));
  return { client, call };
}

function todoState(server, id) {
  return JSON.parse(server.cli('todo', 'show', id, '--json')).todo.state;
}

// A fenced claim on `queue`: the claim's answer.
async function claim(w, queue) {
  const got = await w.call('claim_next', { queue, require_fence: true });
  assert.notEqual(got.empty, true, `a todo waits on ${queue}`);
  assert.equal(typeof got.lease_token, 'string');
  return got;
}

// add_todo through the session, required to be a task.
async function addAsTask(session, queue, title) {
  const execution = await session.callTool('add_todo', { queue, title }, { task: { preference: 'require' } });
  assert.equal(execution.kind, 'task');
  return execution;
}

test('the server offers the extension and add_todo is a task whose result the library returns', async () => {
  const c = await connect(relay, token, 'relay-ts-tasks-done');
  const w = await worker(relay, token);
  try {
    assert.deepEqual(c.client.getServerCapabilities().extensions[EXTENSION], {});
    assert.equal(c.session.capabilities.execution, true);

    const execution = await addAsTask(c.session, 'done', 'fix it');
    const taskId = execution.handle.taskId;
    const got = await claim(w, 'done');
    assert.equal(got.todo.title, 'fix it');
    // The endpoint's get_todo names the task the todo is.
    assert.equal((await w.call('get_todo', { id: got.todo.id })).todo.task_id, taskId);
    await w.call('complete', { id: got.todo.id, lease_token: got.lease_token, summary: 'fixed', result: { pr: 12 } });

    const seen = [];
    const { outcome, lastTask } = await within(BOUND_MS, execution.settle({
      onEvent: (e) => { if (e.type === 'task') seen.push(e.task.status); },
    }), 'the task outcome');
    assert.equal(outcome.status, 'completed', `outcome: ${outcome.error?.message} ${JSON.stringify(outcome.error?.cause?.cause?.issues ?? outcome.error?.cause?.cause)}`);
    assert.equal(lastTask.status, 'completed');
    assert.equal(lastTask.taskId, taskId);
    assert.equal(seen.at(-1), 'completed');
    const result = resultFromTaskOutcome(outcome);
    assert.equal(result.isError, false);
    assert.deepEqual(result.structuredContent.result, { pr: 12 });
    assert.equal(result.structuredContent.state, 'done');
    assert.equal(result.structuredContent.id, got.todo.id);
    assert.deepEqual(c.errors, []);
  } finally {
    await w.client.close();
    await c.close();
  }
});

test('a worker question is an elicitation the session answers, and the next claim reads the answer', async () => {
  const asked = [];
  const onInputRequest = createApplicationInputHandler({
    elicitation: (request, context) => {
      asked.push({ request, context });
      return { action: 'accept', content: { answer: ANSWER } };
    },
    sampling: () => { throw new Error('relay asks for no sampling'); },
    roots: () => ({ roots: [] }),
  });
  const c = await connect(relay, token, 'relay-ts-tasks-asked', { onInputRequest });
  const w = await worker(relay, token);
  try {
    const execution = await addAsTask(c.session, 'asked', 'deploy');
    const taskId = execution.handle.taskId;
    const statuses = [];
    let resumed;
    const working = new Promise((resolve) => { resumed = resolve; });
    // The driver answers an input request before it polls again, so a working task seen after
    // input_required has the answer.
    const settled = execution.settle({
      onEvent: (e) => {
        if (e.type !== 'task') return;
        statuses.push(e.task.status);
        if (e.task.status === 'working' && statuses.includes('input_required')) resumed();
      },
    });

    const first = await claim(w, 'asked');
    const asking = await w.call('request_input', { id: first.todo.id, lease_token: first.lease_token, question: QUESTION });
    assert.equal(asking.state, 'input_required');
    await within(BOUND_MS, working, 'the task working again after the answer');

    assert.equal(asked.length, 1, 'one input request, answered once');
    const { request, context } = asked[0];
    assert.equal(request.kind, 'elicitation');
    assert.equal(request.params.mode, 'form');
    assert.equal(request.params.message, QUESTION);
    assert.deepEqual(request.params.requestedSchema.required, ['answer']);
    assert.equal(request.params.requestedSchema.properties.answer.type, 'string');
    assert.equal(context.scope, 'task');
    assert.equal(context.delivery, 'task-update');
    assert.equal(context.taskId, taskId);
    assert.equal(context.inputId, 'q1', 'the key is the attempt that asked');
    assert.ok(c.sent.includes('tasks/update'));

    const second = await claim(w, 'asked');
    assert.equal(second.todo.id, first.todo.id);
    const prior = second.prior_attempts[0];
    assert.equal(prior.question, QUESTION);
    assert.equal(prior.answer, ANSWER);
    assert.equal(prior.answered_by, `endpoint:${ENDPOINT}`);
    await w.call('complete', { id: second.todo.id, lease_token: second.lease_token, result: { region: ANSWER } });

    const { outcome } = await within(BOUND_MS, settled, 'the task outcome');
    assert.deepEqual(resultFromTaskOutcome(outcome).structuredContent.result, { region: ANSWER });
    assert.equal(asked.length, 1);
    assert.deepEqual(c.errors, []);
  } finally {
    await w.client.close();
    await c.close();
  }
});

test('cancelling through the library cancels the todo, claimed or pending', async () => {
  const c = await connect(relay, token, 'relay-ts-tasks-cancel');
  const w = await worker(relay, token);
  try {
    // A claimed task, cancelled through its execution.
    const execution = await addAsTask(c.session, 'cancel', 'stop me');
    const got = await claim(w, 'cancel');
    await within(BOUND_MS, execution.cancel(), 'the cancel ack');
    const { outcome } = await within(BOUND_MS, execution.settle(), 'the cancelled outcome');
    assert.equal(outcome.status, 'cancelled');
    assert.equal(todoState(relay, got.todo.id), 'canceled');
    // The worker is fenced off at its next heartbeat.
    const hb = await w.client.callTool({ name: 'heartbeat', arguments: { id: got.todo.id, lease_token: got.lease_token } });
    assert.equal(hb.isError, true);
    assert.equal(hb.structuredContent.error.code, 'conflict');
    // The server says cancelled too (tasks/get through the library's controller).
    assert.equal((await c.session.task(execution.handle.taskId).snapshot()).status, 'cancelled');

    // A pending task, cancelled by its id through the session.
    const pending = await addAsTask(c.session, 'cancel', 'never claimed');
    await within(BOUND_MS, c.session.cancelTask(pending.handle.taskId), 'the cancel ack');
    assert.equal((await within(BOUND_MS, pending.result(), 'the outcome')).status, 'cancelled');
    const listed = (await w.call('list_todos', { queue: 'cancel' })).todos.find((t) => t.title === 'never claimed');
    assert.equal(todoState(relay, listed.id), 'canceled');
    assert.equal((await c.session.task(pending.handle.taskId).snapshot()).status, 'cancelled');
    assert.equal(answer(await w.client.callTool({ name: 'claim_next', arguments: { queue: 'cancel' } })).empty, true);
    assert.deepEqual(c.errors, []);
  } finally {
    await w.client.close();
    await c.close();
  }
});

// The server here suggests polling every 60 s, and its listen watcher looks every 60 s too, but
// it looks once as soon as a stream opens: a task that finished before the listen is heard at
// once. The library settles it from the notification, without a tasks/get.
test('notifications/tasks on a listen stream settle the task without polling', async () => {
  const c = await connect(slow, slowToken, 'relay-ts-tasks-heard');
  const w = await worker(slow, slowToken);
  try {
    const execution = await addAsTask(c.session, 'heard', 'listen for me');
    const taskId = execution.handle.taskId;
    const events = [];
    const settled = execution.settle({ onEvent: (e) => { if (e.type === 'task') events.push(e.task); } });
    const got = await claim(w, 'heard');
    await w.call('complete', { id: got.todo.id, lease_token: got.lease_token, result: { heard: true } });

    // contributeTaskFilterV2 adds task ids to listen params; the SDK's listen takes their filter.
    const sub = await c.client.listen(contributeTaskFilterV2({ notifications: {} }, [taskId]).notifications);
    try {
      const { outcome, lastTask } = await within(10_000, settled, 'the task outcome from a notification');
      assert.deepEqual(resultFromTaskOutcome(outcome).structuredContent.result, { heard: true });
      assert.equal(lastTask.status, 'completed');
      assert.equal(events[0].suggestedPollIntervalMs, 60_000, 'the first look would have been in 60 s');
      assert.equal(events.at(-1).status, 'completed');
      assert.deepEqual(c.sent.filter((m) => m === 'tasks/get'), [], 'no poll was needed');
      assert.deepEqual(c.errors, []);
    } finally {
      await sub.close();
    }
  } finally {
    await w.client.close();
    await c.close();
  }
});
