// The identity provider the OIDC tests sign in through: oidc-provider (the certified Node implementation) on
// loopback, set up from a JSON file the test writes (node provider.mjs SETUP.json). It issues ID tokens with the
// accounts' groups and tenant, and JWT access tokens for the resource servers the setup names (the audience).
//
// setup: {port, jwks: {keys: [private JWK]}, accounts: {name: {claims}}, clients: [oidc-provider client
//         metadata, plus inferd_tenant and token_ttl_s for client-credentials apps], resources: [audience]}
// Prints "ready <issuer>" once it listens.
import { readFileSync } from "node:fs";
import Provider from "oidc-provider";

const setup = JSON.parse(readFileSync(process.argv[2], "utf8"));
const issuer = `http://127.0.0.1:${setup.port}`;
const clients = new Map(setup.clients.map((c) => [c.client_id, c]));

const provider = new Provider(issuer, {
  clients: setup.clients,
  jwks: setup.jwks,
  extraClientMetadata: { properties: ["inferd_tenant", "token_ttl_s"] },
  async findAccount(ctx, id) {
    const account = setup.accounts[id];
    if (!account) return undefined;
    return { accountId: id, async claims() { return { sub: id, ...account }; } };
  },
  claims: { openid: ["sub"], profile: ["preferred_username"], groups: ["groups", "inferd_tenant"] },
  scopes: ["openid", "profile", "groups", "offline_access"],
  conformIdTokenClaims: false, // the groups in the ID token, as identity providers can be set to do
  features: {
    devInteractions: { enabled: true }, // its own login form: any password, the login names the account
    clientCredentials: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: (ctx, client, oneOf) => oneOf,
      useGrantedResource: () => false,
      getResourceServerInfo(ctx, resource, client) {
        if (!setup.resources.includes(resource)) throw new Error(`unknown resource ${resource}`);
        const ttl = clients.get(client.clientId)?.token_ttl_s ?? 300;
        return { scope: "api", audience: resource, accessTokenTTL: ttl, accessTokenFormat: "jwt",
                 jwt: { sign: { alg: "RS256" } } };
      },
    },
  },
  async extraTokenClaims(ctx, token) {
    const tenant = token.kind === "ClientCredentials" ? clients.get(token.clientId)?.inferd_tenant
      : setup.accounts[token.accountId]?.inferd_tenant;
    return tenant ? { inferd_tenant: tenant } : undefined;
  },
  pkce: { required: () => true },
  ttl: { IdToken: 300, AccessToken: 300, Interaction: 600, Session: 600, Grant: 600 },
});
provider.proxy = false;
provider.listen(setup.port, "127.0.0.1", () => console.log(`ready ${issuer}`));
