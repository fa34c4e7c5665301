// A transparent HTTP proxy that adds `Authorization: Bearer <token>` to every request.
//
// Why: @modelcontextprotocol/conformance (0.1.x and 0.2.0-alpha.12 alike) connects to a server with a bare URL and has no
// option for request headers, while every relay endpoint requires a bearer token. Everything
// else passes through unchanged, in both directions and streamed (SSE included): method, path,
// body, and the client's own Host and Origin headers (the suite's dns-rebinding scenario sends
// foreign ones on purpose, and the server must see them to refuse them).
//
// Usage: RELAY_TOKEN=… node auth-proxy.mjs http://127.0.0.1:PORT
// Prints `proxy on http://127.0.0.1:PORT` once listening. The token is read from the
// environment so it never appears in a process listing or a log.
import http from 'node:http';

const upstream = new URL(process.argv[2] ?? '');
const token = process.env.RELAY_TOKEN;
if (!token) {
  console.error('auth-proxy: set RELAY_TOKEN to the endpoint bearer token');
  process.exit(2);
}

const server = http.createServer((req, res) => {
  const headers = { ...req.headers, authorization: `Bearer ${token}` };
  const out = http.request(
    {
      host: upstream.hostname,
      port: upstream.port,
      method: req.method,
      path: req.url,
      headers,
    },
    (answer) => {
      res.writeHead(answer.statusCode ?? 502, answer.headers);
      answer.pipe(res);
    },
  );
  out.on('error', (e) => {
    if (!res.headersSent) res.writeHead(502, { 'content-type': 'text/plain' });
    res.end(`auth-proxy: upstream error: ${e.message}\n`);
  });
  req.pipe(out);
  // The client went away (e.g. closed an SSE stream): close the upstream request too.
  res.on('close', () => out.destroy());
});

server.listen(0, '127.0.0.1', () => {
  const { port } = server.address();
  console.log(`proxy on http://127.0.0.1:${port}`);
});
for (const sig of ['SIGTERM', 'SIGINT']) process.on(sig, () => process.exit(0));
