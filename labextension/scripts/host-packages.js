#!/usr/bin/env node
/*
 * Writes the "core package" description that build-labextension needs
 * (--core-path): which packages the JupyterLab host provides. Every runtime
 * dependency of this extension is a JupyterLab/Lumino package the host already
 * loads, so all of them are shared singletons and none is bundled. Generating
 * it from package.json keeps the build free of the jupyterlab Python package
 * (hatch's isolated build env does not have it) and of a copied core manifest.
 */
const fs = require('fs');
const path = require('path');

const root = path.resolve(__dirname, '..');
const pkg = require(path.join(root, 'package.json'));
const deps = Object.keys(pkg.dependencies || {});
const outDir = path.join(root, 'build', 'host');
fs.mkdirSync(outDir, { recursive: true });
fs.writeFileSync(
  path.join(outDir, 'package.json'),
  JSON.stringify(
    {
      name: '@jupyter-gpufrac/host',
      private: true,
      dependencies: {},
      jupyterlab: { singletonPackages: deps }
    },
    null,
    2
  ) + '\n'
);
